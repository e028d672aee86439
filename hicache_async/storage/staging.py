"""Buffers a storage call owns, so that a call given up on never writes into memory that
holds other data.

A caller that stops waiting for a call (a deadline: `AbandonedCall`) cannot stop the call
itself: a backend's transfer under way cannot be recalled, so its bytes may land long
after, wherever it was told to put them. So such a call is given a buffer of its own,
leased from a pool for the call, and the bytes go on from it only while the caller still
waits. When the call ends the buffer goes back to the pool; when it was abandoned, the
buffer is quarantined, out of the pool, until the call has really returned. Each buffer is
registered with the adapter once (`register_memory`), so a zero-copy backend moves bytes
in and out of it in place.
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import mmap
import threading
from collections.abc import Callable, Iterator

from ..errors import StorageError
from .base import AbandonedCall

log = logging.getLogger(__name__)

MIN_BUFFER = 64 << 10   # smallest buffer made
HUGE_PAGE = 2 << 20


class StagingPool:
    def __init__(self, register: Callable[[memoryview], None],
                 on_quarantine: Callable[[int], None] = lambda delta: None) -> None:
        """`register(view)` is called once per new buffer; `on_quarantine(delta)` with the
        bytes each quarantine adds (positive) and each release gives back (negative)."""
        self._register, self._on_quarantine = register, on_quarantine
        self._free: list[tuple[int, int, memoryview]] = []   # (size, serial, buffer), smallest first
        self._serials = itertools.count()
        self._lock = threading.Lock()
        self.quarantined_bytes = 0   # held by abandoned calls that have not returned yet
        self.buffer_bytes = 0        # every buffer made, free, leased or quarantined

    @contextlib.contextmanager
    def lease(self, nbytes: int) -> Iterator[memoryview]:
        """`nbytes` of a buffer for one call, back in the pool when the block ends; when an
        AbandonedCall leaves the block, only once that call has returned."""
        buf = self._take(nbytes)
        abandoned: AbandonedCall | None = None
        try:
            yield buf[:nbytes]
        except AbandonedCall as exc:
            abandoned = exc
            raise
        finally:
            if abandoned is None:
                self._give_back(buf)
            else:
                self._quarantine(buf, abandoned)

    def _take(self, nbytes: int) -> memoryview:
        with self._lock:
            at = bisect.bisect_left(self._free, (nbytes,))
            if at < len(self._free):
                return self._free.pop(at)[2]
        size = _rounded(nbytes)
        buf = memoryview(_anonymous(size))
        try:
            self._register(buf)
        except StorageError as exc:     # memory left unpinned still works, through the backend's copies
            log.warning("staging buffer of %d bytes not registered with the storage: %s", size, exc)
        with self._lock:
            self.buffer_bytes += size
        return buf

    def _give_back(self, buf: memoryview) -> None:
        with self._lock:
            bisect.insort(self._free, (buf.nbytes, next(self._serials), buf))

    def _quarantine(self, buf: memoryview, call: AbandonedCall) -> None:
        with self._lock:
            self.quarantined_bytes += buf.nbytes
        self._on_quarantine(buf.nbytes)
        call.when_returned(lambda: self._release(buf))

    def _release(self, buf: memoryview) -> None:
        with self._lock:
            self.quarantined_bytes -= buf.nbytes
        self._on_quarantine(-buf.nbytes)
        self._give_back(buf)


def _rounded(nbytes: int) -> int:
    """A buffer size for `nbytes`: few sizes (powers of two, then multiples of a huge page), so
    one buffer serves later leases, and little waste."""
    if nbytes <= HUGE_PAGE:
        return max(MIN_BUFFER, 1 << (nbytes - 1).bit_length())
    return -(-nbytes // HUGE_PAGE) * HUGE_PAGE


def _anonymous(size: int) -> mmap.mmap:
    """Page-aligned memory of its own, in huge pages where the kernel has them: a transfer into
    it then runs as fast as into the host pool (one into a malloc'd bytearray measured 30% slower)."""
    mem = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem
