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

A storage call may outlive its caller's patience (`AbandonedCall`) and go on writing where
it was told to. A prefetch of whole pages (or of any objects that are one run of bytes in
the host pool) reads straight into the host pages, and verifies them there, so its bytes
cross memory once, as the bound a verified read can reach does; a call of it given up on
comes back in `PrefetchResult.late`, and the owner of the pages (the step ledger's
quarantine) keeps them from other KV until that call has returned. A whole page that lies in
a few runs of an engine's buffer (K and V apart) moves in place too, as its runs in order,
checksummed over them. Its object holds the page's bytes in our order (layer by layer), or,
where the store's layout names the pool's `page_order` (rank-suffix keys over a buffer whose
memory order takes fewer runs, `guarded_store`), in memory order: then a `page_first` page is
two runs, not one a token and layer, and its objects live under a namespace of their own, so
objects of the other order miss instead of being misread. Objects
that are strided views of the pool (a head group of a page) read into staging the call owns
(`staging.py`), quarantined by the pool, and are copied into the host pages, while still in
cache, only as long as the caller waits; from an adapter that `lands_each` object in order, that staging
is a small ring the read streams through, checked and copied beside the reader
(`checksums.py`). A backup writes such objects from staging too, leased for the call and
reused across calls, each gathered just before its header is made. It makes no gather or
header after its caller gave up, so bytes it reads late from pages that moved on fail their
checksum: a miss, never another page's KV under this key.

The store heals (`healer.py`): a prefetch that ends at a damaged copy of this reader's own
object, or at one that may be (shorter than ours), leaves that key and every later key it
did not read to the next backup of each, which proves each damaged before it removes and
rewrites it; so one recompute's backups heal a whole prefix, and nothing another writer may
own is removed.
"""
from __future__ import annotations

import contextlib
import ctypes
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
from ..storage.base import FORGED, MISSING, AbandonedCall, StorageAdapter, buffer_address
from ..storage.staging import StagingPool
from ..topology import RankCoords
from .checksums import Ahead, Behind, InPlace, checks_inline
from .healer import Healer
from .objects import HEADER_BYTES, NO_TENANT, damaged, encode_header, expected_prefix, expected_prefixes, intact

PREFETCH_CHUNK_PAGES = 256  # most pages per storage call; `cancel` is honoured between calls
STAGING_BYTES = 32 << 20    # most bytes per staged prefetch call, unless one page is more
MIN_RUN_BYTES = 4 << 10     # a page in runs moves in place when each run is at least this...
MAX_RUNS = 512              # ...and they are at most this many (an object's parts are one readv)


@dataclass
class BackupResult:
    ok: list[bool]        # per page: stored (or already present, or another rank's to write)
    bytes: int = 0        # bytes this call wrote
    pages: int = 0        # pages this call wrote (any of their objects; the others were stored already)
    errors: int = 0       # objects that failed to store
    skipped: int = 0      # pages the adapter found already stored
    healed: int = 0       # objects rewritten in place of a damaged copy a prefetch had found


@dataclass
class PrefetchResult:
    pages: int = 0        # leading pages read and verified into the host pages
    bytes: int = 0
    corrupt: int = 0      # objects that failed verification, or of another size (treated as misses)
    damaged: int = 0      # of those, damaged copies of this reader's own: rewritten by their next backup
    forged: int = 0       # objects that failed authentication in a sealed store (misses too)
    missing: int = 0      # objects absent from a page whose other objects were read
    errors: int = 0       # failed storage calls
    late: list[AbandonedCall] = field(default_factory=list)
    """Calls given up on that may still write into these host pages: keep them from other
    KV until each has `returned()`."""


@dataclass
class StoreCounters:
    """Cumulative over the store's life; updated under a lock, read freely."""

    corrupt_objects: int = 0
    forged_objects: int = 0
    missing_objects: int = 0
    storage_errors: int = 0
    healed_objects: int = 0      # damaged copies of ours removed and written afresh by a backup
    bytes_written: int = 0
    bytes_read: int = 0
    quarantined_bytes: int = 0   # a gauge: staging held by abandoned calls not yet returned
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
        self.staging = StagingPool(adapter.register_memory,
                                   lambda delta: self.counters.add(quarantined_bytes=delta))
        # host tensor, its bytes and its pages' object runs, by address; the tensor held so an
        # address is never reused
        self._hosts: dict[int, tuple[torch.Tensor, memoryview, list[tuple[int, int]]]] = {}
        self._pinned: set[int] = set()
        self._hosts_lock = threading.Lock()
        self.healer = Healer(adapter, self.staging, lambda: self.counters.add(storage_errors=1))

    # -- helpers -------------------------------------------------------------------------

    def _host_bytes(self, host: HostPool) -> tuple[memoryview, list[tuple[int, int]]]:
        """The host pool's bytes (none when its pages are too many small runs to move in
        place), registered with the adapter once it can be (backups read them in place, and
        prefetches of whole pages read into them in place); and where the bytes of a whole-page
        object lie in its page (`HostPool.stored_runs`: in memory order when this store's
        layout names the pool's)."""
        ptr = host.tensor.data_ptr()
        with self._hosts_lock:
            if ptr not in self._hosts:
                runs = host.stored_runs(self.layout.page_order)
                movable = host.tensor if _movable(runs) else host.tensor[:0]
                self._hosts[ptr] = (host.tensor, tensor_bytes(movable).cast("B"), runs)
            _, pool, runs = self._hosts[ptr]
            if ptr not in self._pinned and pool.nbytes:
                try:
                    self.adapter.register_memory(pool)
                    self._pinned.add(ptr)
                except StorageError:    # unpinned memory still works, through the backend's copies
                    pass                # and the next backup tries again
            return pool, runs

    def _in_place(self, host: HostPool, pages: list[int],
                  specs: list[list[ObjectSpec]]) -> list[list[list[memoryview] | None]]:
        """Each object's runs of bytes in the host pool when it is a whole page (every layer
        and head this rank holds), else None: slices of one view, far cheaper than a tensor
        view per object. A key scheme gives every page objects of the same layers and heads, so
        which objects are whole pages is decided once; none are, in a pool of too small runs."""
        pool, runs = self._host_bytes(host)
        layers, heads = host.layout.num_layers, host.layout.kv_heads
        whole = [len(spec.layers) == layers and len(spec.heads) == heads and bool(pool.nbytes)
                 for spec in specs[0]] if specs else []
        step = host.tensor.stride(0) * host.tensor.element_size()
        return [[[pool[page * step + at:page * step + at + n] for at, n in runs] if w else None
                 for w in whole] for page in pages]

    def _slot(self, host: HostPool, page: int, spec: ObjectSpec) -> torch.Tensor:
        """The host-pool view of one object's payload (a view, maybe not contiguous), its
        elements in the object's order."""
        if len(spec.layers) == self.layout.num_layers and len(spec.heads) == self.layout.kv_heads:
            return host.stored_page(page, self.layout.page_order)
        l0, h0 = spec.layers.start - self.layout.first_layer, spec.heads.start - self.layout.first_head
        at = [slice(None)] * len(self.layout.axes)
        if self.layout.head_axis is not None:
            at[self.layout.head_axis] = slice(h0, h0 + len(spec.heads))
        return host.tensor[(page, slice(l0, l0 + len(spec.layers)), *at)]

    def _dest(self, host: HostPool, page: int, spec: ObjectSpec) -> list[memoryview] | torch.Tensor:
        """Where a payload that is not a whole page goes: its bytes when they are one run,
        else the (strided) tensor view."""
        slot = self._slot(host, page, spec)
        return [tensor_bytes(slot).cast("B")] if slot.is_contiguous() else slot

    def _write_pages(self, page_hashes: list[str]) -> range:
        """Indices of the pages this rank writes."""
        n, c = len(page_hashes), self.coords
        if not self.keys.writes or (self.cp_mode == "rank0" and c.cp_rank != 0):
            return range(0)
        if self.cp_mode == "split" and self.keys.cp_shared and c.cp_size > 1:
            return cp_page_slice(n, c.cp_rank, c.cp_size)
        return range(n)

    # -- L2 -> L3 ------------------------------------------------------------------------

    def backup(self, page_hashes: list[str], host: HostPool, host_pages: list[int], *,
               tenant: bytes = NO_TENANT) -> BackupResult:
        """Store the given host pages under their hashes, as `tenant`'s (8 bytes); the adapter
        skips what it already holds, except damaged copies of ours (`healer.py`: rewritten)."""
        _check_args(page_hashes, host_pages, tenant)
        result = BackupResult(ok=[True] * len(page_hashes))
        mine = self._write_pages(page_hashes)
        if not mine:
            return result
        specs = [self.keys.objects(page_hashes[i]) for i in mine]
        in_place = self._in_place(host, [host_pages[i] for i in mine], specs)
        jobs, owners = [], []     # (spec, its runs in the host pool, or the view a staged copy gathers)
        for i, page_specs, page_runs in zip(mine, specs, in_place):
            for spec, runs in zip(page_specs, page_runs):
                jobs.append((spec, runs if runs is not None else self._slot(host, host_pages[i], spec)))
                owners.append(i)
        sizes = [_nbytes(source) for _, source in jobs]
        corrupt = self.fault == "corrupt-stored"    # wrong bytes, checksummed as if right
        staged = [corrupt or isinstance(source, torch.Tensor) for _, source in jobs]
        keys = [spec.key for spec, _ in jobs]
        healing = self.healer.heal(keys, sizes, lambda j: expected_prefix(keys[j], jobs[j][0], self.namespace,
                                                                         sizes[j], tenant))
        try:
            gathered = sum(n for n, s in zip(sizes, staged) if s)
            with self.staging.lease(gathered) if gathered else contextlib.nullcontext(memoryview(b"")) as staging:
                headers = memoryview(bytearray(HEADER_BYTES * len(jobs)))
                parts, at = [], 0
                for j, (_, source) in enumerate(jobs):
                    payload = [staging[at:at + sizes[j]]] if staged[j] else source
                    at += sizes[j] if staged[j] else 0
                    parts.append([headers[HEADER_BYTES * j:HEADER_BYTES * (j + 1)], *payload])

                def encode(group: range) -> None:
                    """Each object's header, after gathering a staged one (so only objects the
                    adapter writes are gathered, each just before it is checksummed)."""
                    for j in group:
                        spec, source = jobs[j]
                        if staged[j]:
                            _gather(source, parts[j][1], host.tensor.dtype)
                            if corrupt:
                                torch.frombuffer(parts[j][1], dtype=host.tensor.dtype)[0] += 1
                        parts[j][0][:] = encode_header(spec.key, spec, self.namespace, parts[j][1:], tenant)

                ahead = Ahead(sizes, encode)
                try:
                    stored = self.adapter.batch_set_parts(keys, parts, ready=ahead.wait)
                except StorageError:
                    ahead.abandon()  # no gather or header from now on: bytes read late fail their checksum
                    raise            # (staging a call given up on may still read stays its own till it returns)
        except StorageError:
            stored = [False] * len(jobs)
        written = set()
        for j, (i, ok) in enumerate(zip(owners, stored)):
            if not ok:
                result.ok[i] = False
                result.errors += 1
            elif ahead.used[j]:
                result.bytes += HEADER_BYTES + sizes[j]
                result.healed += keys[j] in healing
                written.add(i)
        result.skipped = sum(1 for i in mine if result.ok[i] and i not in written)
        result.pages = len(written)
        self.counters.add(bytes_written=result.bytes, storage_errors=result.errors, healed_objects=result.healed)
        return result

    def evicted_pages(self) -> set[str]:
        """Pages of this store's namespace, any rank's, that lost an object to the adapter's
        eviction since the last call: none of them can be read whole any more. Both key schemes
        name an object `{page hash}_{namespace digest}...`, so the first two fields of a key say
        whose page it is."""
        ours = self.keys.objects("")[0].key.split("_")[1]
        named = (key.split("_", 2) for key in self.adapter.evicted())
        return {fields[0] for fields in named if len(fields) > 1 and fields[1] == ours}

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
                 cancel: threading.Event | None = None, *, tenant: bytes = NO_TENANT) -> PrefetchResult:
        """Read the leading run of stored pages, `tenant`'s (8 bytes), into `host_pages`; stop
        at the first gap or bad object (one that is or may be a damaged copy of ours goes to
        the healer with every later object, unread). The pages after the verified run may hold
        anything, and while a call in `late` runs, it may still write into them."""
        _check_args(page_hashes, host_pages, tenant)
        result = PrefetchResult()
        if not page_hashes:
            return result
        specs = [self.keys.objects(h) for h in page_hashes]
        in_place = self._in_place(host, host_pages, specs)
        dests = [[dest if dest is not None else self._dest(host, page, spec) for spec, dest in zip(page_specs, ours)]
                 for page, page_specs, ours in zip(host_pages, specs, in_place)]
        direct = all(isinstance(dest, list) for page_dests in dests for dest in page_dests)
        page_bytes = sum(HEADER_BYTES + _nbytes(d) for d in dests[0])
        per_call = PREFETCH_CHUNK_PAGES if direct or self.adapter.lands_each else \
            max(1, min(PREFETCH_CHUNK_PAGES, STAGING_BYTES // page_bytes))
        for start in range(0, len(page_hashes), per_call):
            if cancel is not None and cancel.is_set():
                break
            stop = min(start + per_call, len(page_hashes))
            good, doubt = self._read_chunk(specs[start:stop], dests[start:stop], tenant, result, direct)
            result.pages += good
            if doubt is not None:
                at, proven = doubt
                self.healer.found([spec.key for page in specs[start:] for spec in page][at:], proven)
            if good < stop - start:
                break
        self.counters.add(bytes_read=result.bytes, corrupt_objects=result.corrupt, forged_objects=result.forged,
                          missing_objects=result.missing, storage_errors=result.errors)
        return result

    def _read_chunk(self, specs: list[list[ObjectSpec]], dests: list[list], tenant: bytes,
                    result: PrefetchResult, direct: bool) -> tuple[int, tuple[int, bool] | None]:
        """Read a run of pages in one call, each object checked as it lands; the number of
        leading good pages, and, when the run ended at an object that is (True) or may be
        (False) a damaged copy of ours, that object's index and which. `direct`: payloads land
        in their host pages, and only headers in staging; else everything lands in staging (a
        ring when the adapter lands each object in turn) and each good object is copied to its
        host page. What an object is checked against (its size, its header up to the
        checksum) is worked out before the call, so what runs per object while the bytes
        stream in, evicting everything else from cache, is one checksum, one compare and at
        most one copy from cache; for a direct read checked inline, straight from the adapter's
        report of the object (`InPlace`)."""
        per_page = len(specs[0])
        objects = [(spec, dest) for page_specs, page_dests in zip(specs, dests)
                   for spec, dest in zip(page_specs, page_dests)]
        targets = [dest for _, dest in objects]
        sizes = [HEADER_BYTES + _nbytes(dest) for dest in targets]
        prefixes = expected_prefixes([spec for spec, _ in objects], self.namespace,
                                     [_nbytes(dest) for dest in targets[:per_page]], tenant)
        copy_to = None if direct else targets
        if direct and checks_inline():
            checks = InPlace(lambda i, n: _verdict(n, sizes[i], prefixes[i], parts[i][0], parts[i][1:]))
        else:
            checks = Behind(sizes, lambda group, got: _land(group, got, sizes, prefixes, parts, copy_to),
                            streamed=self.adapter.lands_each and not direct, each=self.adapter.lands_each)
        if direct:
            offsets, nbytes = list(range(0, HEADER_BYTES * len(sizes), HEADER_BYTES)), HEADER_BYTES * len(sizes)
        else:
            offsets, nbytes = checks.offsets()
        try:
            with self.staging.lease(nbytes) as staging:
                parts = [[staging[at:at + HEADER_BYTES], *(target if direct else [staging[at + HEADER_BYTES:at + n]])]
                         for at, n, target in zip(offsets, sizes, targets)]
                try:
                    got = self.adapter.batch_get_parts([spec.key for spec, _ in objects], parts, landed=checks.landed)
                except StorageError as exc:
                    checks.abandon()    # work under way ends, no other starts: the pages are freed next
                    if direct and isinstance(exc, AbandonedCall):
                        result.late.append(exc)
                    raise
                outcomes = checks.finish(got)
        except StorageError:
            result.errors += 1
            return 0, None
        good_sizes: list[int] = []  # bytes of each leading verified object
        doubt = None
        for group_sizes, end in outcomes:
            good_sizes += group_sizes
            if end is not None:
                result.corrupt += end in ("corrupt", "damaged", "short")
                result.forged += end == "forged"
                result.missing += end == "missing" and len(good_sizes) % per_page != 0
                result.damaged += end == "damaged"
                if end in ("damaged", "short"):
                    doubt = (len(good_sizes), end == "damaged")
                break
        good = len(good_sizes) // per_page
        result.bytes += sum(good_sizes[:good * per_page])
        return good, doubt


def _check_args(page_hashes: list[str], host_pages: list[int], tenant: bytes) -> None:
    if len(page_hashes) != len(host_pages):
        raise ValueError(f"{len(page_hashes)} page hashes for {len(host_pages)} host pages")
    if len(tenant) != len(NO_TENANT):
        raise ValueError(f"a tenant is {len(NO_TENANT)} bytes, got {len(tenant)}")


def _movable(runs: list[tuple[int, int]]) -> bool:
    """Whether pages in these runs move in place: one run, or a few big enough that a part
    each costs little beside their bytes."""
    return len(runs) == 1 or (len(runs) <= MAX_RUNS and min(n for _, n in runs) >= MIN_RUN_BYTES)


def _gather(source: list[memoryview] | torch.Tensor, into: memoryview, dtype: torch.dtype) -> None:
    """Copy an object's bytes, its runs or a strided view of the host pool, into staging."""
    if isinstance(source, torch.Tensor):
        torch.frombuffer(into, dtype=dtype).view(source.shape).copy_(source)
        return
    at = buffer_address(into)
    for run in source:
        ctypes.memmove(at, buffer_address(run), run.nbytes)
        at += run.nbytes


def _nbytes(dest: list[memoryview] | torch.Tensor) -> int:
    return dest.nbytes if isinstance(dest, torch.Tensor) else sum(run.nbytes for run in dest)


def _land(group: range, got: list[int], sizes: list[int], prefixes: list[bytes], parts: list[list],
          targets: list | None) -> tuple[list[int], str | None]:
    """Sizes of the leading intact objects of a group, each copied from staging to its host
    page (`targets`; None: read there), and what ended the group early (None: nothing)."""
    ok = []
    for i, n in zip(group, got):
        header, *payload = parts[i]
        end = _verdict(n, sizes[i], prefixes[i], header, payload)
        if end is not None:
            return ok, end
        target = targets[i] if targets is not None else None
        if isinstance(target, torch.Tensor):
            target.copy_(torch.frombuffer(payload[0], dtype=target.dtype).view(target.shape))
        elif target is not None:        # its runs, one GIL-free copy each
            at = buffer_address(payload[0])
            for run in target:
                ctypes.memmove(buffer_address(run), at, run.nbytes)
                at += run.nbytes
        ok.append(n)
    return ok, None


def _verdict(got: int, size: int, prefix: bytes, header: memoryview, payload: list) -> str | None:
    """Why an object read as `got` bytes is no good (missing, forged, corrupt, damaged: corrupt
    and a broken copy of this reader's own object, or short: a shorter object, unread, whose
    header alone can say whether it is ours cut short); None: intact. A longer one is
    another writer's (corrupt): every writer of ours stores exactly the header and payload."""
    if got == size:
        if intact(header, prefix, payload):
            return None
        return "damaged" if damaged(header, prefix) else "corrupt"
    if got == MISSING:
        return "missing"
    if got == FORGED:
        return "forged"
    return "short" if 0 <= got < size else "corrupt"
