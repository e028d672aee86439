"""L3 adapter over a Mooncake distributed store, using its zero-copy batch calls.

Memory handed to `register_memory` (the host pool) is read and written in place; any other
part (headers, copies of non-contiguous slices) goes through a per-thread registered
staging buffer. Return codes: -704 not found is a miss, -705 already exists is success
(keys are content-addressed), -900 RPC failure is an outage (StorageError), other
negatives fail just that object. A put never replaces a stored object, so the page store
heals a damaged one by removing it (`batch_remove`) just before it puts the right bytes.

Where the caller's checksums run on spare cores (`config.CHECKSUM_WORKERS`), a large batch
moves in a few zero-copy calls (`_runs`) rather than one, so they overlap the transfer: the
first put and the last get are small, since the first put waits for its headers and the
last get's verification follows the call. Elsewhere a batch is one call: each extra call
costs a master round trip and there is nothing to overlap. A put first asks which objects
are already stored (one RPC): a put of a stored key reports plain success (not -705) without
moving anything, and the caller checksums and counts only what is really written.

The connection, its setup and close are `client.py`'s; the backend's flags and per-run master
are `session.py`'s.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hicache_async.config import CHECKSUM_WORKERS
from hicache_async.errors import StorageError
from hicache_async.storage.base import MISSING, WRONG_SIZE, buffer_address, call_abandoned

from .client import MooncakeClient, in_call

if TYPE_CHECKING:
    import torch

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
SIZE_MISMATCH = (-600, -800)   # INVALID_PARAMS, TRANSFER_FAIL: what a buffer of the wrong size gets
RPC_FAIL = -900
RUN_BYTES = 8 << 20      # one zero-copy call moves about this much at most (it stays in cache)...
EDGE_BYTES = 2 << 20     # ...and the first put / last get about this much, growing 2x a call


def _runs(sizes: list[int], small_tail: bool) -> list[range]:
    """Consecutive runs of objects, one call each, small at the head (puts) or tail (gets)."""
    if not CHECKSUM_WORKERS:
        return [range(len(sizes))] if sizes else []
    order = sizes[::-1] if small_tail else sizes
    runs, start, acc, limit = [], 0, 0, EDGE_BYTES
    for i, n in enumerate(order):
        acc += n
        if acc >= limit:
            runs.append(range(start, i + 1))
            start, acc, limit = i + 1, 0, min(limit * 2, RUN_BYTES)
    if start < len(order):
        runs.append(range(start, len(order)))
    if small_tail:
        return [range(len(sizes) - r.stop, len(sizes) - r.start) for r in reversed(runs)]
    return runs


class MooncakeStorage(MooncakeClient):
    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self._staging_bufs: dict[int, torch.Tensor] = {}  # by thread id

    # -- memory --------------------------------------------------------------------------

    def _pin(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise StorageError(f"mooncake register_buffer of {size} bytes failed with code {rc}")
        with self._lock:
            self._regions.append((ptr, ptr + size))

    def register_memory(self, view: memoryview) -> None:
        ptr = buffer_address(memoryview(view).cast("B"))
        if ptr is not None and not self._pinned(ptr, view.nbytes):
            self._pin(ptr, view.nbytes)

    def _pinned(self, ptr: int, size: int) -> bool:
        for start, stop in self._regions:
            if start <= ptr and ptr + size <= stop:
                return True
        return False

    def _staging(self, size: int) -> torch.Tensor:
        """This thread's registered staging buffer, grown to at least `size` bytes.

        Held by the adapter, not the thread, so registered memory is never freed before close().
        """
        me = threading.get_ident()
        old = self._staging_bufs.get(me)
        if old is not None and old.numel() >= size:
            return old
        if old is not None:
            self._store.unregister_buffer(old.data_ptr())
            with self._lock:
                self._regions.remove((old.data_ptr(), old.data_ptr() + old.numel()))
        import torch  # here, not at the top: `--help` loads this class for its flags

        buf = torch.empty(max(size, 1 << 16), dtype=torch.uint8)
        self._pin(buf.data_ptr(), buf.numel())
        self._staging_bufs[me] = buf
        return buf

    def _plan(self, parts: list[Sequence[memoryview]]):
        """Pointers and sizes per object, the staging copies and the staging buffer's address.

        A part outside registered memory goes through this thread's staging buffer: each copy
        is (the part's address, or the part itself when read-only; offset in staging; bytes),
        and parts that are neighbours in memory (a batch's headers) share one copy. Parts of an
        object that are neighbours in one registered region move as one buffer.
        """
        ptrs, sizes, slots, copies, need = [], [], [], [], 0
        for ps in parts:
            row, row_sizes, joinable = [], [], False
            for p in ps:
                view = memoryview(p).cast("B")
                ptr, n = buffer_address(view), view.nbytes
                if ptr is None or not self._pinned(ptr, n):
                    slots.append((row, len(row), need))
                    last = copies[-1] if copies else None
                    if ptr is not None and last is not None and last[0] == ptr - last[2]:
                        copies[-1] = (last[0], last[1], last[2] + n)
                    else:
                        copies.append((ptr if ptr is not None else view, need, n))
                    need += n
                    joinable = False
                elif joinable and row[-1] + row_sizes[-1] == ptr and self._pinned(row[-1], row_sizes[-1] + n):
                    row_sizes[-1] += n      # neighbours in one pinned region (a read's staged header and
                    continue                # payload): one buffer for the transfer engine, not two
                else:
                    joinable = True
                row.append(ptr)
                row_sizes.append(n)
            ptrs.append(row)
            sizes.append(row_sizes)
        base = self._staging(need).data_ptr() if need else 0
        for row, i, offset in slots:
            row[i] = base + offset
        return ptrs, sizes, copies, base

    # -- calls ---------------------------------------------------------------------------

    def _check(self, codes: list[int], op: str) -> None:
        if RPC_FAIL in codes:
            raise StorageError(f"mooncake {op} failed: master {self.master} unreachable (code {RPC_FAIL})")

    @in_call
    def batch_exists(self, keys: list[str]) -> int:
        if not keys:
            return 0
        codes = self._store.batch_is_exist(keys)
        n = 0
        while n < len(codes) and codes[n] == 1:
            n += 1
        if n < len(codes) and codes[n] != 0:
            raise StorageError(f"mooncake batch_is_exist failed with code {codes[n]} (master {self.master})")
        return n

    @in_call
    def batch_remove(self, keys: list[str]) -> None:
        """Forced: the lease a get leaves (the master's, some seconds) must not keep a damaged
        object, and a reader whose transfer this cuts short gets bytes that fail verification, a
        miss. An object whose removal fails otherwise stays: the put that follows skips it as
        held, and the next read finds it damaged again."""
        if keys:
            self._check(self._store.batch_remove(keys, True), "batch_remove")

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        return self.batch_set_parts(keys, [[memoryview(v)] for v in values])

    @in_call
    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        if not keys:
            return []
        held = self._store.batch_is_exist(keys)
        self._check(held, "batch_is_exist")
        out = [True] * len(keys)
        todo = [i for i, code in enumerate(held) if code != 1]
        for run in _runs([sum(memoryview(p).nbytes for p in parts[i]) for i in todo], small_tail=False):
            batch = [todo[j] for j in run]
            if call_abandoned():    # the caller has moved on: its buffers may hold other data
                for i in todo[run.start:]:
                    out[i] = False
                return out
            for i in batch if ready is not None else ():
                ready(i)
            ptrs, sizes, copies, base = self._plan([parts[i] for i in batch])
            for src, offset, n in copies:
                ctypes.memmove(base + offset, src if isinstance(src, int) else bytes(src), n)
            codes = self._store.batch_put_from_multi_buffers([keys[i] for i in batch], ptrs, sizes)
            self._check(codes, "batch_put")
            for i, code in zip(batch, codes):
                out[i] = code == 0 or code == OBJECT_ALREADY_EXISTS
        return out

    @in_call
    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        if not keys:
            return []
        ptrs, sizes, copies, base = self._plan([[b] for b in buffers])
        codes = self._store.batch_get_into(keys, [p[0] for p in ptrs], [s[0] for s in sizes])
        self._check(codes, "batch_get")
        self._unstage(copies, base)
        return [self._get_result(k, c) for k, c in zip(keys, codes)]

    @in_call
    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        landed: Callable[[int, list[int]], None] | None = None) -> list[int]:
        out: list[int] = []
        for run in _runs([sum(memoryview(p).nbytes for p in ps) for ps in parts], small_tail=True):
            if call_abandoned():    # the caller has moved on: its buffers are not ours to fill
                return out + [MISSING] * (len(keys) - len(out))
            ptrs, sizes, copies, base = self._plan(parts[run.start:run.stop])
            codes = self._store.batch_get_into_multi_buffers(keys[run.start:run.stop], ptrs, sizes)
            self._check(codes, "batch_get")
            self._unstage(copies, base)
            results = [self._get_result(k, c, n) for k, c, n in zip(keys[run.start:run.stop], codes, sizes)]
            out += results
            if landed is not None:
                landed(run.start, results)
        return out

    @staticmethod
    def _unstage(copies, base: int) -> None:
        for dst, offset, n in copies:
            ctypes.memmove(dst, base + offset, n)

    def _get_result(self, key: str, code: int, parts: list[int] | None = None) -> int:
        """What a get of `key` reports. `parts`: the sizes of the parts it was read into; an
        object smaller than they are (which a get into parts refuses) reports its size, unread,
        as the contract asks."""
        if code >= 0:
            return code
        if code == OBJECT_NOT_FOUND:
            return MISSING
        if code in SIZE_MISMATCH:
            held = self._store.get_size(key)
            if held >= 0:
                return held if parts is not None and held < sum(parts) else WRONG_SIZE
        return MISSING
