"""Checksums placed where they cost least: beside the transfer, or right at it while hot.

A backup checksums every object before writing it and a prefetch verifies every object it
read. As a separate pass after a batch, that work reads every byte again from memory (a
batch is larger than the CPU cache), adding a third to half to the traffic of the copy.
So the work is handed out object by object as the transfer reaches it: `Ahead` makes
headers just before the writer needs them, `Behind` verifies what the reader just landed.

Where it runs depends on the machine. With spare cores (CHECKSUM_WORKERS > 0) it runs on a
pool, in groups of about GROUP_BYTES, headers up to AHEAD_BYTES ahead of the writer and
verification right behind the reader, overlapping the I/O (which releases the GIL; the
XXH3 binding holds it). On a machine of fewer than 4 CPUs the I/O thread and the backend's
copy threads already fill them: on the 2-vCPU reference VM a checksum thread beside the I/O
measured slower, not faster, even calling XXH3 without the GIL (they share the memory
bandwidth and, under load, one core), and so did splitting a Mooncake batch into several
calls for it to overlap (each call costs a master round trip). There each object is
checksummed on the transferring thread itself, just before it is written (so the write
reads it from cache) or right after it is read, while it sits in that core's cache: XXH3
over 512 KiB costs ~12 us hot, ~37 us from memory. A read straight into the caller's pages
is then checked from the reader's own report of each object (`InPlace`), with no hand-off
and no fence: dropping them sped a file prefetch of 512 KiB objects up by about 5 %.

A read from an adapter that `lands_each` object in order streams through a ring instead:
staging of RING_SLOTS groups (`Behind.offsets`), reused in turn, so the reader writes into cache and the
checks read from it. There the work (a check and a copy into host pages, about what the
read itself costs) runs on a thread beside the reader even on two cores (`landing_pool`),
and the reader moves on to a slot only once the work of the group that used it is done.

Either way the work runs beside a storage call that its caller may abandon (a deadline),
while the call goes on. Work that reads or writes pages its caller may hand to other KV
runs only while the caller still waits: `abandon` waits for work under way and stops any
later work, atomically (a `_Fence`), so no header is made from pages handed to other KV,
and no verified read is copied into them. `InPlace` checks only read pages that their
owner keeps from other KV until the call returns (the late-write quarantine), so a check
still running after `abandon` reads nothing but that call's own bytes.
"""
from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

from ..config import CHECKSUM_WORKERS
from ..errors import StorageError

T = TypeVar("T")
GROUP_BYTES = 4 << 20    # pooled work is handed out in groups of about this many bytes...
HOT_BYTES = 512 << 10    # ...inline work in groups that fit one core's L2 cache twice over
AHEAD_BYTES = 8 << 20    # pooled headers run at most this far ahead of the writer
RING_GROUP = 4 << 20     # a streamed read's groups: fewer hand-offs to the landing thread...
RING_SLOTS = 2           # ...and its staging holds this many, reused in turn (8 MiB: in L3)

_pool: ThreadPoolExecutor | None = None
_landing: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class _Done:
    """Work already run, answering as a pool's future would (and cheaper to make)."""

    __slots__ = ("_value", "_error")

    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def cancel(self) -> bool:
        return False

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class _Here:
    """Runs work at once on the calling thread: the placement without spare cores."""

    @staticmethod
    def submit(fn: Callable[..., T], *args) -> _Done:
        try:
            return _Done(fn(*args))
        except Exception as exc:  # noqa: BLE001 - delivered through the result, as a pool would
            return _Done(error=exc)


def checks_inline() -> bool:
    """Whether checks run on the transferring thread itself: no spare cores."""
    return not CHECKSUM_WORKERS


def checksum_pool() -> ThreadPoolExecutor | _Here:
    """The process-wide checksum workers (their tasks never submit to them: no deadlock)."""
    global _pool
    if checks_inline():
        return _Here()
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(CHECKSUM_WORKERS, thread_name_prefix="hicache-checksum")
        return _pool


def landing_pool() -> ThreadPoolExecutor:
    """Where a streamed read's groups are checked: the checksum workers, or on a machine
    without them one thread of its own."""
    global _landing
    if CHECKSUM_WORKERS:
        return checksum_pool()
    with _pool_lock:
        if _landing is None:
            _landing = ThreadPoolExecutor(1, thread_name_prefix="hicache-landing")
        return _landing


def groups(sizes: list[int], target: int | None = None) -> list[range]:
    """Consecutive index ranges of about `target` bytes: by default GROUP_BYTES on a pool,
    HOT_BYTES inline (so each group is checked while it is still in cache); the last may
    hold less."""
    target = target or (GROUP_BYTES if CHECKSUM_WORKERS else HOT_BYTES)
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= target:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _outcome(future: Future | _Done, fn: Callable[[], T]) -> T:
    """The future's result; if no worker has started it, run it here rather than wait idle."""
    if future.cancel():
        return fn()
    return future.result()


class _Fence:
    """Lets work touch a caller's pages only while the caller still waits for the call.

    Work goes through `run`; `close` (the caller gave up) waits for work under way and turns
    away any later with a StorageError: whichever comes first wins. Work runs once per group
    of objects, so `run` takes a plain lock twice and nothing more; only a `close` that finds
    work under way makes an event to wait on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._idle: threading.Event | None = None
        self.closed = False

    def run(self, work: Callable[..., T], *args) -> T:
        with self._lock:
            if self.closed:
                raise StorageError("storage call abandoned: its pages are no longer its own")
            self._active += 1
        try:
            return work(*args)
        finally:
            with self._lock:
                self._active -= 1
                if self._idle is not None and not self._active:
                    self._idle.set()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if not self._active:
                return
            if self._idle is None:
                self._idle = threading.Event()
        self._idle.wait()


class Ahead:
    """`work(group)` for the groups of a batch, done before a consumer uses their items.

    The consumer calls `wait(i)` before it uses item i. Pooled work runs at most AHEAD_BYTES
    beyond the item asked for, so a consumer that skips items (already stored) wastes
    little. `used[i]`: the consumer asked for item i. After `abandon`, `wait` raises
    StorageError for any item whose work had not run.
    """

    def __init__(self, sizes: list[int], work: Callable[[range], None]) -> None:
        self._fence = _Fence()
        self._work = functools.partial(self._fence.run, work)
        self._groups = groups(sizes)
        self._bytes = [sum(sizes[j] for j in r) for r in self._groups]
        self._group_of = [g for g, r in enumerate(self._groups) for _ in r]
        self._futures: list[Future | _Done | None] = [None] * len(self._groups)
        self._done = [False] * len(self._groups)
        self._pool = checksum_pool()
        self._lock = threading.Lock()
        self.used = [False] * len(sizes)

    def wait(self, i: int) -> None:
        g = self._group_of[i]
        with self._lock:
            self.used[i] = True
            if self._done[g]:
                return
            window = AHEAD_BYTES if CHECKSUM_WORKERS else 0
            ahead, h = 0, g
            while h < len(self._groups) and (h == g or ahead < window):
                if self._futures[h] is None:
                    self._futures[h] = self._pool.submit(self._work, self._groups[h])
                ahead += self._bytes[h]
                h += 1
            future = self._futures[g]
        _outcome(future, lambda: self._work(self._groups[g]))
        with self._lock:
            self._done[g] = True

    def abandon(self) -> None:
        """The consumer's caller gave up on it: no work starts from now on."""
        self._fence.close()


class Behind(Generic[T]):
    """`work(group, results)` for each group of a batch as soon as its items have landed.

    `landed(start, results)` takes the adapter's per-item results in order. `finish(results)`,
    once the call returned, lands whatever the adapter did not report and returns every
    group's outcome in order once all have run; `abandon()`, once the call failed or was
    given up on, waits for work under way and starts no more. Either way, when it returns,
    no work of this batch is still touching its buffers, and late reports are ignored.
    """

    def __init__(self, sizes: list[int], work: Callable[[range, list[int]], T], streamed: bool = False,
                 each: bool = True) -> None:
        """`streamed`: the items land in a ring (`offsets`), so `landed` returns only once the
        slot the reader fills next is free. `each`: the adapter lands items one at a time, so
        groups are checked while in cache; else all land as the call returns, and checks made
        inline are one pass over the batch, with no hand-off per group."""
        self._fence = _Fence()
        self._work = functools.partial(self._fence.run, work)
        self._sizes = sizes
        if streamed:
            self._groups = groups(sizes, RING_GROUP)
        elif each or CHECKSUM_WORKERS:
            self._groups = groups(sizes)
        else:
            self._groups = [range(len(sizes))] if sizes else []
        self._starts = {group.start: g for g, group in enumerate(self._groups)}
        self._got: list[int] = []
        self._futures: list[Future | _Done] = []
        self._pool = landing_pool() if streamed else checksum_pool()
        self._streamed = streamed
        self._closed = False
        self._lock = threading.Lock()

    def offsets(self) -> tuple[list[int], int]:
        """Where each item lands in the staging of its call, and that staging's bytes: one
        after another, or when streamed, group g in slot g % RING_SLOTS of a ring."""
        if not self._streamed:
            return list(itertools.accumulate(self._sizes, initial=0)), sum(self._sizes)
        slot = max((sum(self._sizes[i] for i in group) for group in self._groups), default=0)
        offsets = []
        for g, group in enumerate(self._groups):
            at = (g % RING_SLOTS) * slot
            for i in group:
                offsets.append(at)
                at += self._sizes[i]
        return offsets, slot * min(RING_SLOTS, len(self._groups))

    def landed(self, start: int, results: list[int]) -> None:
        with self._lock:
            futures = self._futures
            if not (self._closed or self._fence.closed) and start == len(self._got):
                self._got += results
                groups, got = self._groups, self._got
                while len(futures) < len(groups) and groups[len(futures)].stop <= len(got):
                    group = groups[len(futures)]
                    futures.append(self._pool.submit(self._work, group, got[group.start:group.stop]))
            reuse = self._starts.get(start + len(results), 0) - RING_SLOTS if self._streamed else -1
        if 0 <= reuse < len(futures):     # the reader's next group fills this one's slot: not before its work
            wait([futures[reuse]])

    def finish(self, results: list[int]) -> list[T]:
        """Every group's outcome, in order, for the call's `results`."""
        self.landed(len(self._got), results[len(self._got):])
        with self._lock:
            self._closed = True
            futures = list(self._futures)
        return [_outcome(f, lambda g=g: self._work(g, self._got[g.start:g.stop]))
                for f, g in zip(futures, self._groups)]

    def abandon(self) -> None:
        """The call failed or its caller gave up on it: no work starts from now on."""
        self._fence.close()


class InPlace:
    """`check(i, result)` of each object as it lands, on the reading thread, until one fails.

    For reads straight into the caller's pages with no spare cores, where Behind's hand-off
    and fence are not needed (see the module's docstring) and cost more than the check.
    `check` gives why an object is no good, or None. `landed`, `finish` and `abandon` answer
    as Behind's do; `finish` gives one group's outcome.
    """

    def __init__(self, check: Callable[[int, int], str | None]) -> None:
        self._check = check
        self._good: list[int] = []     # results of the leading objects that passed
        self._end: str | None = None   # why the object after them failed
        self._abandoned = False

    def landed(self, start: int, results: list[int]) -> None:
        good, check = self._good, self._check
        if self._end is not None or self._abandoned or start != len(good):
            return
        for i, n in enumerate(results, start):
            self._end = check(i, n)
            if self._end is not None:
                return
            good.append(n)

    def finish(self, results: list[int]) -> list[tuple[list[int], str | None]]:
        self.landed(len(self._good), results[len(self._good):])
        return [(self._good, self._end)]

    def abandon(self) -> None:
        """The caller gave up: its answer is not wanted, so no more checks run."""
        self._abandoned = True
