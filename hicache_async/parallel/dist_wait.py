"""Await torch.distributed work from the scheduler's event loop without blocking it.

A finished collective is usually seen within a few hundred microseconds, so the wait first polls
`is_completed()`, yielding both the loop and the CPU between polls (two cores are shared by up to
four ranks, and gloo's own threads need them to make progress). After that it hands the Work to a
waiter thread that blocks in `wait()` and wakes the loop: no polling, no burnt core. gloo's
point-to-point Works never report `is_completed()` and their `wait()` must be called exactly once:
`recv` goes to the waiter thread at once (pp_sync reaps its sends by age, see there).
"""
from __future__ import annotations

import os
import re
import time

import anyio
import torch
import torch.distributed as dist

from ..daemon_threads import DaemonThreads
from ..errors import HiCacheError
from ..transfer.events import HostEvent
from .topology import RankCoords

SPIN_S = 300e-6


async def wait_work(work: dist.Work, *, what: str, coords: RankCoords,
                    timeout_s: float, spin_s: float = SPIN_S) -> None:
    """Return once `work` is done; SyncTimeout after `timeout_s`, HiCacheError if it failed."""
    started = time.perf_counter()
    while time.perf_counter() - started < spin_s:
        if work.is_completed():
            _settle_inline(work, what, coords)
            return
        os.sched_yield()
        await anyio.sleep(0)
    waited = _WAITERS.submit(work.wait)
    finished = HostEvent()
    waited.add_done_callback(lambda _: finished.set())
    await finished.wait(timeout_s, f"{coords.label()}: {what}")   # the spin above is negligible
    error = waited.exception()
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


def _settle_inline(work: dist.Work, what: str, coords: RankCoords) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        raise HiCacheError(f"{coords.label()}: {what} failed: {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """First line of a gloo error without its '[source.cc:123] ' prefix."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0])


# One thread per concurrent wait: a receive stuck on a slow peer cannot delay noticing an unrelated
# collective. Daemon threads, not anyio.to_thread's workers (which are not daemons): a wait stuck
# on a dead peer must not hold up the exit of a rank that already timed out.
_WAITERS = DaemonThreads("hicache-work-waiter")
