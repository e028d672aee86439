"""Await torch.distributed work from the scheduler's event loop without blocking it.

A finished collective is usually seen within a few hundred microseconds, so the wait first polls
`is_completed()`, yielding both the loop and the CPU between polls (two cores are shared by up to
four ranks, and gloo's own threads need them to make progress). After that it hands the Work to a
waiter thread that blocks in `wait()` and wakes the loop: no polling, no burnt core. gloo's
point-to-point Works never report `is_completed()` and their `wait()` must be called exactly once:
`recv` goes to the waiter thread at once, and `isend` returns a SendHandle that a waiter thread
marks complete, so the scheduler can reap finished sends without blocking.
"""
from __future__ import annotations

import asyncio
import os
import queue
import re
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import HiCacheError, SyncTimeout
from ..topology import RankCoords

SPIN_S = 300e-6


async def wait_work(work: dist.Work | SendHandle, *, what: str, coords: RankCoords,
                    timeout_s: float, spin_s: float = SPIN_S) -> None:
    """Return once `work` is done; SyncTimeout after `timeout_s`, HiCacheError if it failed."""
    started = time.perf_counter()
    while time.perf_counter() - started < spin_s:
        if work.is_completed():
            _settle_inline(work, what, coords)
            return
        os.sched_yield()
        await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()
    _WAITERS.submit(work, lambda error: _call_soon(loop, done, error))
    remaining = timeout_s - (time.perf_counter() - started)
    try:
        error = await asyncio.wait_for(done, max(remaining, 0.0))
    except asyncio.TimeoutError:
        raise SyncTimeout(
            f"{coords.label()}: {what} did not complete within {timeout_s:g} s") from None
    if error is not None:
        raise HiCacheError(f"{coords.label()}: {what} failed: {_reason(error)}") from error


async def all_reduce(tensor: torch.Tensor, *, op: dist.ReduceOp, group: dist.ProcessGroup | None,
                     what: str, coords: RankCoords, timeout_s: float) -> None:
    """In-place reduce over `group`; a group of one (None) already holds the answer."""
    if group is None:
        return
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    await wait_work(work, what=what, coords=coords, timeout_s=timeout_s)


async def recv(tensor: torch.Tensor, *, src: int, tag: int, what: str, coords: RankCoords,
               timeout_s: float) -> None:
    """Receive into `tensor` from global rank `src`."""
    work = dist.irecv(tensor, src=src, tag=tag)
    await wait_work(work, what=what, coords=coords, timeout_s=timeout_s, spin_s=0.0)


def isend(tensor: torch.Tensor, *, dst: int, tag: int) -> SendHandle:
    """Start a send to global rank `dst`; keep `tensor` unchanged until the send is reaped."""
    return SendHandle(dist.isend(tensor, dst=dst, tag=tag))


class SendHandle:
    """A started send whose is_completed() tells the truth, so finished sends can be reaped.

    gloo's send Work never reports is_completed(); a waiter thread waits on it instead.
    wait() re-raises the send's failure; wait_work() accepts a SendHandle like any Work.
    """

    def __init__(self, work: dist.Work) -> None:
        self._finished = threading.Event()
        self._error: BaseException | None = None
        _WAITERS.submit(work, self._finish)

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._finished.set()

    def is_completed(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> bool:
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return True


def _settle_inline(work: dist.Work | SendHandle, what: str, coords: RankCoords) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise HiCacheError(f"{coords.label()}: {what} failed: {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """First line of a gloo error without its '[source.cc:123] ' prefix."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0])


class _Waiters:
    """Daemon threads that block in Work.wait() and then call back; idle ones are reused.

    One thread per concurrent wait, so a receive stuck on a slow peer cannot delay noticing an
    unrelated collective. Daemon, so a wait on a dead peer never holds up process exit.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, work: dist.Work,
               on_done: Callable[[BaseException | None], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._serve, name="hicache-work-waiter", daemon=True).start()
        self._jobs.put((work, on_done))

    def _serve(self) -> None:
        while True:
            work, on_done = self._jobs.get()
            try:
                work.wait()
                error = None
            except RuntimeError as exc:
                error = exc
            on_done(error)
            with self._lock:
                self._idle += 1


def _call_soon(loop: asyncio.AbstractEventLoop, done: asyncio.Future,
               error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, done, error)
    except RuntimeError:  # the loop has closed: its waiter already timed out
        pass


def _resolve(done: asyncio.Future, error: BaseException | None) -> None:
    if not done.done():
        done.set_result(error)


_WAITERS = _Waiters()
