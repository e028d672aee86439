"""PageStore: the L3 facade the cache core calls to back up and prefetch host pages.

It turns pages into verified storage objects through a key scheme and an adapter. It runs
on worker threads, is safe to call from several at once, and never raises for a storage
failure: outcomes and failures come back in the result and in `counters`.

Context parallel: only *writes* are split. With keys shared by CP ranks (unified, or MLA)
and cp_mode "split", each CP rank backs up its `cp_page_slice` of the batch; with
per-CP-rank keys (rank-suffix MHA) each rank writes its own copy. cp_mode "rank0" leaves
the writing to CP rank 0. Every CP rank *reads* all the pages it asks for, since each holds
the full KV of its pages.

Every object carries a checksum, computed on backup and verified on prefetch, beside the
transfer (`checksums.py`): headers just ahead of the adapter's writes, verification just
behind its reads, while the bytes are in cache. A prefetch reads until the first object the
adapter reports missing, and a backup lets the adapter skip objects it already holds; the one
existence probe (`stored_run`) serves a replay, which must know before a prefetch what an
earlier run left in L3.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .. import faults
from ..config import CP_MODES
from ..errors import StorageError, UsageError
from ..keys import KeyScheme, ObjectSpec
from ..layout import KVLayout
from ..partition import cp_page_slice
from ..pools import HostPool, tensor_bytes
from ..storage.base import MISSING, StorageAdapter
from ..topology import RankCoords
from .checksums import Ahead, Behind
from .objects import HEADER_BYTES, encode_header, expected_prefix, intact

PREFETCH_CHUNK_PAGES = 256  # most pages per storage call; `cancel` is honoured between calls


@dataclass
class BackupResult:
    ok: list[bool]        # per page: stored (or already present, or another rank's to write)
    bytes: int = 0        # bytes this call wrote
    errors: int = 0       # objects that failed to store
    skipped: int = 0      # pages the adapter found already stored


@dataclass
class PrefetchResult:
    pages: int = 0        # leading pages read and verified into the host pages
    bytes: int = 0
    corrupt: int = 0      # objects that failed verification (treated as misses)
    missing: int = 0      # objects absent from a page whose other objects were read
    errors: int = 0       # failed storage calls


@dataclass
class StoreCounters:
    """Cumulative over the store's life; updated under a lock, read freely."""

    corrupt_objects: int = 0
    missing_objects: int = 0
    storage_errors: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)


class PageStore:
    def __init__(self, adapter: StorageAdapter, layout: KVLayout, keys: KeyScheme,
                 coords: RankCoords = RankCoords(), cp_mode: str = "split") -> None:
        if cp_mode not in CP_MODES:
            raise UsageError(f"unknown cp mode {cp_mode!r}: expected split or rank0")
        self.adapter, self.layout, self.keys, self.coords = adapter, layout, keys, coords
        self.cp_mode = cp_mode
        self.fault = faults.injected()
        self.namespace = layout.namespace()
        self.counters = StoreCounters()
        # host tensor and its bytes, by address; the tensor held so an address is never reused
        self._registered: dict[int, tuple[torch.Tensor, memoryview]] = {}
        self._register_lock = threading.Lock()

    # -- helpers -------------------------------------------------------------------------

    def _register(self, host: HostPool) -> memoryview:
        """The host pool's bytes, registered with the adapter on first use."""
        with self._register_lock:
            if host.tensor.data_ptr() not in self._registered:
                view = tensor_bytes(host.tensor)
                self.adapter.register_memory(view)
                self._registered[host.tensor.data_ptr()] = (host.tensor, view)
            return self._registered[host.tensor.data_ptr()][1]

    @staticmethod
    def _whole_page(host: HostPool, pool: memoryview, page: int, spec: ObjectSpec) -> memoryview | None:
        """The object's bytes in place when it is a whole host page (every layer and head this
        rank holds), else None: a slice of one view, far cheaper than a tensor view per object."""
        if len(spec.layers) != host.tensor.shape[1] or len(spec.heads) != host.tensor.shape[4]:
            return None
        size = host.layout.page_bytes
        return pool[page * size:(page + 1) * size]

    def _slot(self, host: HostPool, page: int, spec: ObjectSpec) -> torch.Tensor:
        """The host-pool view of one object's payload (a view, maybe not contiguous)."""
        l0, h0 = spec.layers.start - self.layout.first_layer, spec.heads.start - self.layout.first_head
        return host.tensor[page, l0:l0 + len(spec.layers), :, :, h0:h0 + len(spec.heads), :]

    def _write_pages(self, page_hashes: list[str]) -> range:
        """Indices of the pages this rank writes."""
        n, c = len(page_hashes), self.coords
        if not self.keys.writes or (self.cp_mode == "rank0" and c.cp_rank != 0):
            return range(0)
        if self.cp_mode == "split" and self.keys.cp_shared and c.cp_size > 1:
            return cp_page_slice(n, c.cp_rank, c.cp_size)
        return range(n)

    # -- L2 -> L3 ------------------------------------------------------------------------

    def backup(self, page_hashes: list[str], host: HostPool, host_pages: list[int]) -> BackupResult:
        """Store the given host pages under their hashes; the adapter skips what it already holds."""
        if len(page_hashes) != len(host_pages):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(host_pages)} host pages")
        result = BackupResult(ok=[True] * len(page_hashes))
        mine = self._write_pages(page_hashes)
        if not mine:
            return result
        pool = self._register(host)
        jobs, owners, copies = [], [], []     # copies: tensors behind payloads, kept alive
        for i in mine:
            for spec in self.keys.objects(page_hashes[i]):
                payload = self._whole_page(host, pool, host_pages[i], spec)
                if payload is None or self.fault == "corrupt-stored":
                    copies.append(self._slot(host, host_pages[i], spec).contiguous())
                    if self.fault == "corrupt-stored":   # wrong bytes, checksummed as if right
                        copies[-1] = copies[-1].clone()
                        copies[-1].view(-1)[0] += 1.0
                    payload = tensor_bytes(copies[-1])
                jobs.append((spec, payload))
                owners.append(i)
        headers = memoryview(bytearray(HEADER_BYTES * len(jobs)))
        parts = [[headers[HEADER_BYTES * j:HEADER_BYTES * (j + 1)], payload]
                 for j, (_, payload) in enumerate(jobs)]

        def encode(group: range) -> None:
            for j in group:
                parts[j][0][:] = encode_header(jobs[j][0].key, jobs[j][0], self.namespace, parts[j][1])

        ahead = Ahead([p[1].nbytes for p in parts], encode)
        try:
            stored = self.adapter.batch_set_parts([spec.key for spec, _ in jobs], parts, ready=ahead.wait)
        except StorageError:
            stored = [False] * len(jobs)
        written = set()
        for j, (i, ok) in enumerate(zip(owners, stored)):
            if not ok:
                result.ok[i] = False
                result.errors += 1
            elif ahead.used[j]:
                result.bytes += HEADER_BYTES + parts[j][1].nbytes
                written.add(i)
        result.skipped = sum(1 for i in mine if result.ok[i] and i not in written)
        self.counters.add(bytes_written=result.bytes, storage_errors=result.errors)
        return result

    # -- L3 -> L2 ------------------------------------------------------------------------

    def stored_run(self, page_hashes: list[str]) -> int:
        """How many leading pages have every object this rank reads in storage (0 if the call
        fails): present, not yet verified."""
        if not page_hashes:
            return 0
        keys = [spec.key for h in page_hashes for spec in self.keys.objects(h)]
        try:
            present = self.adapter.batch_exists(keys)
        except StorageError:
            self.counters.add(storage_errors=1)
            return 0
        return present // (len(keys) // len(page_hashes))

    def prefetch(self, page_hashes: list[str], host: HostPool, host_pages: list[int],
                 cancel: threading.Event | None = None) -> PrefetchResult:
        """Read the leading run of stored pages into `host_pages`; stop at the first gap or bad object."""
        if len(page_hashes) != len(host_pages):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(host_pages)} host pages")
        result = PrefetchResult()
        if not page_hashes:
            return result
        pool = self._register(host)
        for start in range(0, len(page_hashes), PREFETCH_CHUNK_PAGES):
            if cancel is not None and cancel.is_set():
                break
            stop = min(start + PREFETCH_CHUNK_PAGES, len(page_hashes))
            specs = [self.keys.objects(h) for h in page_hashes[start:stop]]
            good = self._read_chunk(specs, host, pool, host_pages[start:stop], result)
            result.pages += good
            if good < stop - start:
                break
        self.counters.add(bytes_read=result.bytes, corrupt_objects=result.corrupt,
                          missing_objects=result.missing, storage_errors=result.errors)
        return result

    def _read_chunk(self, specs: list[list[ObjectSpec]], host: HostPool, pool: memoryview,
                    host_pages: list[int], result: PrefetchResult) -> int:
        """Read a run of pages in one call, each object checked as it lands; the number of
        leading good pages. What an object is checked against (its size, its header up to the
        checksum) is worked out before the call, so what runs per object while the bytes stream
        in, evicting everything else from cache, is one checksum and one compare."""
        per_page = len(specs[0])
        headers = memoryview(bytearray(HEADER_BYTES * per_page * len(specs)))
        keys, parts, staged, prefixes = [], [], [], []   # staged: (slot, staging) when read out of place
        for page, page_specs in zip(host_pages, specs):
            for spec in page_specs:
                data, out_of_place = self._whole_page(host, pool, page, spec), None
                if data is None:
                    slot = self._slot(host, page, spec)
                    target = slot if slot.is_contiguous() else torch.empty(slot.shape, dtype=slot.dtype)
                    data, out_of_place = tensor_bytes(target), (slot, target) if target is not slot else None
                at = HEADER_BYTES * len(keys)
                keys.append(spec.key)
                parts.append((headers[at:at + HEADER_BYTES], data))
                staged.append(out_of_place)
                prefixes.append(expected_prefix(spec.key, spec, self.namespace, data.nbytes))
        sizes = [HEADER_BYTES + data.nbytes for _, data in parts]
        behind = Behind(sizes, lambda group, got: _check(group, got, sizes, prefixes, parts, staged))
        try:
            outcomes = behind.finish(self.adapter.batch_get_parts(keys, parts, landed=behind.landed))
        except StorageError:
            behind.finish(None)   # nothing of this call may still write into the host pages
            result.errors += 1
            return 0
        good_sizes: list[int] = []  # bytes of each leading verified object
        for group_sizes, end in outcomes:
            good_sizes += group_sizes
            if end is not None:
                result.corrupt += end == "corrupt"
                result.missing += end == "missing" and len(good_sizes) % per_page != 0
                break
        good = len(good_sizes) // per_page
        result.bytes += sum(good_sizes[:good * per_page])
        return good


def _check(group: range, got: list[int], sizes: list[int], prefixes: list[bytes], parts: list[tuple],
           staged: list) -> tuple[list[int], str | None]:
    """Sizes of the leading intact objects of a group, and what ended it early (None: nothing)."""
    ok = []
    for i, n in zip(group, got):
        if n == MISSING:
            return ok, "missing"
        if n != sizes[i] or not intact(parts[i][0], prefixes[i], parts[i][1]):
            return ok, "corrupt"
        if staged[i] is not None:
            staged[i][0].copy_(staged[i][1])
        ok.append(n)
    return ok, None
