"""L3 adapter over a Mooncake distributed store, using its zero-copy batch calls.

Memory handed to `register_memory` (the host pool) is read and written in place; any other
part (headers, copies of non-contiguous slices) goes through a per-thread registered
staging buffer. Return codes: -704 not found is a miss, -705 already exists is success
(keys are content-addressed), -900 RPC failure is an outage (StorageError), other
negatives fail just that object.

Objects live in a segment some client mounts. A rank client mounts none by default
(`segment_bytes=0`): its puts land in the segment holder started beside the master (see
`holder.py`), so they outlive the rank. Give it `segment_bytes` only against a master with
no holder, knowing those objects go when the client closes.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import torch

from hicache_async.errors import StorageError, UsageError
from hicache_async.storage.base import MISSING, WRONG_SIZE, StorageAdapter

from .master import check_reachable

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
SIZE_MISMATCH = (-600, -800)   # INVALID_PARAMS, TRANSFER_FAIL: what a buffer of the wrong size gets
RPC_FAIL = -900


def _address(view: memoryview) -> int | None:
    """Address of a writable buffer, or None for read-only memory (which must be staged)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MooncakeStorage(StorageAdapter):
    def __init__(self, master: str = "127.0.0.1:50051", metadata_url: str | None = None,
                 segment_bytes: int = 0, buffer_bytes: int = 64 << 20,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 connect_timeout_s: float = 3.0, **_options) -> None:
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise UsageError(f"mooncake master must be HOST:PORT, got {master!r}")
        self.master = master
        self.metadata_url = metadata_url or f"http://{host}:8080/metadata"
        # setup() retries for ~90 s against a dead master; probe first so that fails fast.
        check_reachable(master, self.metadata_url, connect_timeout_s)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise UsageError("storage 'mooncake' needs the mooncake extra: "
                             "pip install 'hicache-async[mooncake]'") from None
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, self.metadata_url, segment_bytes, buffer_bytes,
                               protocol, device_name, master)
        if rc != 0:
            raise StorageError(f"mooncake setup against master {master} failed with code {rc}")
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._staging_bufs: dict[int, torch.Tensor] = {}  # by thread id
        self._closed = False

    # -- memory --------------------------------------------------------------------------

    def _pin(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise StorageError(f"mooncake register_buffer of {size} bytes failed with code {rc}")
        with self._lock:
            self._regions.append((ptr, ptr + size))

    def register_memory(self, view: memoryview) -> None:
        ptr = _address(memoryview(view).cast("B"))
        if ptr is not None and not self._pinned(ptr, view.nbytes):
            self._pin(ptr, view.nbytes)

    def _pinned(self, ptr: int, size: int) -> bool:
        return any(a <= ptr and ptr + size <= b for a, b in self._regions)

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
        buf = torch.empty(max(size, 1 << 16), dtype=torch.uint8)
        self._pin(buf.data_ptr(), buf.numel())
        self._staging_bufs[me] = buf
        return buf

    def _plan(self, parts: list[Sequence[memoryview]]):
        """Pointers and sizes per object, plus (part, offset in staging) for staged parts."""
        views = [[memoryview(p).cast("B") for p in ps] for ps in parts]
        addrs = [[_address(v) for v in vs] for vs in views]
        need = sum(v.nbytes for vs, ads in zip(views, addrs) for v, a in zip(vs, ads)
                   if a is None or not self._pinned(a, v.nbytes))
        base = self._staging(need).data_ptr() if need else 0
        ptrs, sizes, staged, offset = [], [], [], 0
        for vs, ads in zip(views, addrs):
            row = []
            for v, a in zip(vs, ads):
                if a is None or not self._pinned(a, v.nbytes):
                    staged.append((v, offset))
                    a, offset = base + offset, offset + v.nbytes
                row.append(a)
            ptrs.append(row)
            sizes.append([v.nbytes for v in vs])
        return ptrs, sizes, staged, base

    # -- calls ---------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise StorageError("mooncake storage is closed")

    def _check(self, codes: list[int], op: str) -> None:
        if RPC_FAIL in codes:
            raise StorageError(f"mooncake {op} failed: master {self.master} unreachable (code {RPC_FAIL})")

    def batch_exists(self, keys: list[str]) -> int:
        self._ensure_open()
        if not keys:
            return 0
        codes = self._store.batch_is_exist(keys)
        n = 0
        while n < len(codes) and codes[n] == 1:
            n += 1
        if n < len(codes) and codes[n] != 0:
            raise StorageError(f"mooncake batch_is_exist failed with code {codes[n]} (master {self.master})")
        return n

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        return self.batch_set_parts(keys, [[memoryview(v)] for v in values])

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]]) -> list[bool]:
        self._ensure_open()
        if not keys:
            return []
        ptrs, sizes, staged, base = self._plan(parts)
        for view, offset in staged:
            ctypes.memmove(base + offset, (ctypes.c_char * view.nbytes).from_buffer_copy(view)
                           if view.readonly else _address(view), view.nbytes)
        codes = self._store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        self._check(codes, "batch_put")
        return [c == 0 or c == OBJECT_ALREADY_EXISTS for c in codes]

    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        self._ensure_open()
        if not keys:
            return []
        ptrs, sizes, staged, base = self._plan([[b] for b in buffers])
        codes = self._store.batch_get_into(keys, [p[0] for p in ptrs], [s[0] for s in sizes])
        self._check(codes, "batch_get")
        self._unstage(staged, base)
        return [self._get_result(k, c) for k, c in zip(keys, codes)]

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]]) -> list[int]:
        self._ensure_open()
        if not keys:
            return []
        ptrs, sizes, staged, base = self._plan(parts)
        codes = self._store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        self._check(codes, "batch_get")
        self._unstage(staged, base)
        return [self._get_result(k, c) for k, c in zip(keys, codes)]

    @staticmethod
    def _unstage(staged, base: int) -> None:
        for view, offset in staged:
            ctypes.memmove(_address(view), base + offset, view.nbytes)

    def _get_result(self, key: str, code: int) -> int:
        if code >= 0:
            return code
        if code == OBJECT_NOT_FOUND:
            return MISSING
        if code in SIZE_MISMATCH and self._store.get_size(key) >= 0:
            return WRONG_SIZE
        return MISSING

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for start, _ in self._regions:
            self._store.unregister_buffer(start)
        self._store.close()
