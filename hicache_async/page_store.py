"""PageStore: the L3 facade the cache core calls to back up and prefetch host pages.

It turns pages into verified storage objects through a key scheme and an adapter. It runs
on worker threads, is safe to call from several at once, and never raises for a storage
failure: outcomes and failures come back in the result and in `counters`.

Context parallel: only *writes* are split. With keys shared by CP ranks (unified, or MLA)
and cp_mode "split", each CP rank backs up its `cp_page_slice` of the batch; with
per-CP-rank keys (rank-suffix MHA) each rank writes its own copy. cp_mode "rank0" leaves
the writing to CP rank 0. Every CP rank *reads* all the pages it asks for, since each holds
the full KV of its pages.

Every object carries a checksum, computed on backup and verified on prefetch. A batch moves
in one storage call; its checksums are split across a small shared thread pool and the
calling thread (xxhash releases the GIL).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from . import faults
from .errors import StorageError, UsageError
from .keys import KeyScheme, ObjectSpec
from .layout import KVLayout
from .partition import cp_page_slice
from .pool import HostPool, tensor_bytes
from .storage.base import MISSING, StorageAdapter
from .storage.objects import HEADER_BYTES, CorruptObject, encode_header, verify
from .topology import RankCoords

CP_MODES = ("split", "rank0")
T = TypeVar("T")
PREFETCH_CHUNK_PAGES = 64  # pages per storage call; `cancel` is honoured between calls
PARALLEL_BYTES = 1 << 20   # below this many payload bytes, checksums stay on the calling thread
CHECKSUM_WORKERS = max(1, min(4, os.cpu_count() or 1) - 1)  # the calling thread makes one more

_checksum_pool: ThreadPoolExecutor | None = None
_checksum_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process-wide checksum workers; their tasks never submit to the pool (no deadlock)."""
    global _checksum_pool
    with _checksum_pool_lock:
        if _checksum_pool is None:
            _checksum_pool = ThreadPoolExecutor(CHECKSUM_WORKERS, thread_name_prefix="hicache-checksum")
        return _checksum_pool


def _split(sizes: list[int]) -> list[range]:
    """Consecutive index ranges of about equal bytes, one per checksum worker plus the caller."""
    total = sum(sizes)
    parts = min(len(sizes), 1 + CHECKSUM_WORKERS, max(1, total // PARALLEL_BYTES))
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if len(out) < parts - 1 and acc * parts >= total * (len(out) + 1):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(sizes)))
    return [r for r in out if r]


def _parallel(fn: Callable[[range], T], sizes: list[int]) -> list[T]:
    """fn over `_split(sizes)`: the first range on this thread, the rest on the pool, in order."""
    ranges = _split(sizes) if sizes else []
    futures = [_pool().submit(fn, r) for r in ranges[1:]]
    first = [fn(ranges[0])] if ranges else []
    return first + [f.result() for f in futures]


@dataclass
class BackupResult:
    ok: list[bool]        # per page: stored (or already present, or another rank's to write)
    bytes: int = 0        # bytes this call wrote
    errors: int = 0       # objects that failed to store, plus a failed existence probe
    skipped: int = 0      # pages found already present


@dataclass
class PrefetchResult:
    pages: int = 0        # leading pages read and verified into the host pages
    bytes: int = 0
    corrupt: int = 0      # objects that failed verification (treated as misses)
    missing: int = 0      # objects the existence probe saw that were gone when read
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
        self._registered: dict[int, torch.Tensor] = {}  # held, so an address is never reused
        self._register_lock = threading.Lock()

    # -- helpers -------------------------------------------------------------------------

    def _register(self, host: HostPool) -> None:
        with self._register_lock:
            if host.tensor.data_ptr() not in self._registered:
                self.adapter.register_memory(tensor_bytes(host.tensor))
                self._registered[host.tensor.data_ptr()] = host.tensor

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
        """Store the given host pages under their hashes, skipping the leading run already stored."""
        if len(page_hashes) != len(host_pages):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(host_pages)} host pages")
        result = BackupResult(ok=[True] * len(page_hashes))
        mine = self._write_pages(page_hashes)
        if not mine:
            return result
        specs = [self.keys.objects(page_hashes[i]) for i in mine]
        try:
            present = self.adapter.batch_exists([s.key for ss in specs for s in ss])
        except StorageError:
            present = 0
            result.errors += 1
        result.skipped = present // len(specs[0])
        self._register(host)
        keys, payloads, owners = [], [], []
        for i, page_specs in zip(mine[result.skipped:], specs[result.skipped:]):
            for spec in page_specs:
                payload = self._slot(host, host_pages[i], spec).contiguous()
                if self.fault == "corrupt-stored":   # wrong bytes, checksummed as if right
                    payload = payload.clone()
                    payload.view(-1)[0] += 1.0
                payloads.append((spec, payload))
                keys.append(spec.key)
                owners.append(i)
        parts = [part for chunk in _parallel(lambda r: self._encode(payloads[r.start:r.stop]),
                                             [t.numel() * t.element_size() for _, t in payloads])
                 for part in chunk]
        try:
            stored = self.adapter.batch_set_parts(keys, parts) if keys else []
        except StorageError:
            stored = [False] * len(keys)
        for i, ok, (_, payload) in zip(owners, stored, payloads):
            if ok:
                result.bytes += HEADER_BYTES + payload.numel() * payload.element_size()
            else:
                result.ok[i] = False
                result.errors += 1
        self.counters.add(bytes_written=result.bytes, storage_errors=result.errors)
        return result

    def _encode(self, payloads: list[tuple[ObjectSpec, torch.Tensor]]) -> list[list[memoryview]]:
        """[header, payload bytes] per object; the caller keeps the payload tensors alive."""
        out = []
        for spec, payload in payloads:
            data = tensor_bytes(payload)
            out.append([memoryview(encode_header(spec.key, spec, self.namespace, data)), data])
        return out

    # -- L3 -> L2 ------------------------------------------------------------------------

    def prefetch(self, page_hashes: list[str], host: HostPool, host_pages: list[int],
                 cancel: threading.Event | None = None) -> PrefetchResult:
        """Read the leading run of stored pages into `host_pages`; stop at the first gap or bad object."""
        if len(page_hashes) != len(host_pages):
            raise ValueError(f"{len(page_hashes)} page hashes for {len(host_pages)} host pages")
        result = PrefetchResult()
        if not page_hashes:
            return result
        specs = [self.keys.objects(h) for h in page_hashes]
        try:
            present = self.adapter.batch_exists([s.key for ss in specs for s in ss]) // len(specs[0])
        except StorageError:
            present = 0
            result.errors += 1
        if present:
            self._register(host)
        for start in range(0, present, PREFETCH_CHUNK_PAGES):
            if cancel is not None and cancel.is_set():
                break
            stop = min(start + PREFETCH_CHUNK_PAGES, present)
            good = self._read_chunk(specs[start:stop], host, host_pages[start:stop], result)
            result.pages += good
            if good < stop - start:
                break
        self.counters.add(bytes_read=result.bytes, corrupt_objects=result.corrupt,
                          missing_objects=result.missing, storage_errors=result.errors)
        return result

    def _read_chunk(self, specs: list[list[ObjectSpec]], host: HostPool, host_pages: list[int],
                    result: PrefetchResult) -> int:
        """Read a run of pages in one call, verify it in parallel; the number of leading good pages."""
        per_page = len(specs[0])
        headers = memoryview(bytearray(HEADER_BYTES * per_page * len(specs)))
        keys, parts, jobs = [], [], []
        for page, page_specs in zip(host_pages, specs):
            for spec in page_specs:
                slot = self._slot(host, page, spec)
                target = slot if slot.is_contiguous() else torch.empty(slot.shape, dtype=slot.dtype)
                header = headers[HEADER_BYTES * len(keys):HEADER_BYTES * (len(keys) + 1)]
                keys.append(spec.key)
                parts.append([header, tensor_bytes(target)])
                jobs.append((spec, slot, target))
        try:
            got = self.adapter.batch_get_parts(keys, parts)
        except StorageError:
            result.errors += 1
            return 0
        sizes: list[int] = []  # bytes of each leading verified object
        for group_sizes, end in _parallel(lambda r: self._check(got[r.start:r.stop], parts[r.start:r.stop],
                                                                jobs[r.start:r.stop]),
                                          [HEADER_BYTES + p[1].nbytes if n != MISSING else 0
                                           for n, p in zip(got, parts)]):
            sizes += group_sizes
            if end is not None:
                result.corrupt += end == "corrupt"
                result.missing += end == "missing"
                break
        good = len(sizes) // per_page
        result.bytes += sum(sizes[:good * per_page])
        return good

    def _check(self, got: list[int], parts, jobs) -> tuple[list[int], str | None]:
        """Sizes of the leading verified objects of a run, and what ended it early (None: nothing)."""
        sizes = []
        for n, (header, data), (spec, slot, target) in zip(got, parts, jobs):
            if n == MISSING:
                return sizes, "missing"
            try:
                if n != HEADER_BYTES + data.nbytes:
                    raise CorruptObject(f"object {spec.key}: read {n} bytes")
                verify(spec.key, spec, self.namespace, header, data)
            except CorruptObject:
                return sizes, "corrupt"
            if target is not slot:
                slot.copy_(target)
            sizes.append(n)
        return sizes, None
