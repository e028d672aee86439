"""A worker's L3 jobs: the backups and prefetches of each plan, run in the background.

They run on an anyio event loop of the worker's own (a blocking portal), their storage calls
on worker threads under one capacity limiter per kind; each finished job is reported once. A
prefetch reads straight into the FILLING slots the scheduler took for it; an L3 call given up
on may still write into the slots past the verified run, and they are reported held until it
returns. A backup stores only slots that still name its pages here, and a prefetch never
writes into a slot a backup reads.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait

import anyio
import anyio.from_thread
import structlog

from hicache_async.kinds import TransferKind
from hicache_async.pools import HostPool
from hicache_async.telemetry import spans

from . import shutdown
from .acks import Acks
from .plan import Job, StepPlan

log = structlog.get_logger(__name__)
IDLE_WAIT_S = 0.05  # longest an engine step with no forward pass waits for a prefetch
_FLUSH_JOBS = itertools.count(-1, -1)     # shutdown's own backups: ids no scheduler hands out


class L3Jobs:
    def __init__(self, stack: contextlib.ExitStack, store, host: HostPool, pages: dict[int, tuple[str, bytes]],
                 acks: Acks, span) -> None:
        """`pages`: the worker's, slot -> (page, tenant) it holds or is filled with; `span(kind,
        pages, req_ids)`: a transfer's span."""
        self.store, self.host, self.pages, self.acks, self._span = store, host, pages, acks, span
        self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal())
        self._limiters = {kind: self._portal.call(anyio.CapacityLimiter, 2) for kind in ("backup", "prefetch")}
        self._lock = threading.Lock()
        self.in_l3: set[str] = set()                     # pages this worker stored or read (for the flush)
        self.reading: Counter[int] = Counter()           # slots its unfinished backups read (no zeros)
        self._running: dict[Future, int] = {}            # jobs under way -> pages they write
        self._prefetching: set[Future] = set()
        self._prefetched: StepPlan | None = None         # the latest plan whose prefetches started

    def start(self, kind: str, job: Job) -> Future | None:
        """The job, in the background; None where there is no store (it ends at once, empty)."""
        if kind == "backup":
            with self._lock:
                self.reading.update(job.slots)     # each slot once a job: a count above zero
        if self.store is None:      # nothing to do, but the scheduler waits for every job
            self._ended(kind, job, 0)
            return None
        future = self._portal.start_task_soon(self._in_thread, kind, job)
        self._running[future] = len(job.hashes) if kind == "backup" else 0
        future.add_done_callback(lambda f: self._running.pop(f, None))
        return future

    def start_prefetches(self, plan: StepPlan) -> None:
        """The plan's prefetches, once (at `begin`, or in `finish` where nothing bound it)."""
        if plan is self._prefetched:
            return
        self._prefetched = plan
        self._prefetching = {f for f in self._prefetching if not f.done()}
        for job in plan.prefetches:
            for slot in job.slots:
                self.pages.pop(slot, None)
            future = self.start("prefetch", job)
            if future is not None:
                self._prefetching.add(future)

    def await_prefetch(self) -> None:
        """An engine step with no forward pass has only L3 to wait for: wait (a little) for a
        prefetch to finish, so its report goes out this step, instead of spinning through empty
        steps that hold the GIL while the reading thread needs it."""
        if self._prefetching:
            wait(self._prefetching, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def evicted(self) -> set[str]:
        """Pages the store evicted since the last call: no longer in L3, for the flush either."""
        evicted = self.store.evicted_pages() if self.store is not None else set()
        self.in_l3.difference_update(evicted)
        return evicted

    async def _in_thread(self, kind: str, job: Job) -> None:
        span = self._span(TransferKind(kind), len(job.hashes), job.req_ids)
        error, pages = None, 0
        try:
            pages = await anyio.to_thread.run_sync(self._run, kind, job, limiter=self._limiters[kind],
                                                   abandon_on_cancel=True)
        except Exception as exc:    # noqa: BLE001 - a failed job is a miss, never a crash
            log.warning("hicache L3 job failed; its pages are a miss", kind=kind, job=job.job, error=str(exc))
            error = exc
        finally:
            self._ended(kind, job, pages)
        spans.finish_transfer(span, error=error, attrs={"hicache.pages_done": pages})

    def _run(self, kind: str, job: Job) -> int:
        return self._backup(job) if kind == "backup" else self._prefetch(job)

    def _ended(self, kind: str, job: Job, pages: int) -> None:
        """The job is over (done, failed or cancelled): its slots are no longer read here, and
        its report goes out."""
        if kind == "backup":
            with self._lock:
                for slot in job.slots:
                    if self.reading[slot] > 1:
                        self.reading[slot] -= 1
                    else:
                        del self.reading[slot]
        self.acks.ended(job.job, pages)

    def _backup(self, job: Job) -> int:
        """Store the job's pages from its slots, up to the first whose slot no longer names it
        here (its save failed or was dropped): never a slot's bytes under another page's key."""
        named = [self.pages.get(s) == (h, job.tenant) for s, h in zip(job.slots, job.hashes)]
        n = named.index(False) if False in named else len(named)
        if n < len(named):
            log.warning("hicache: backup stopped at a slot that no longer holds its page", job=job.job,
                        skipped=len(named) - n)
        if not n:
            return 0
        result = self.store.backup(job.hashes[:n], self.host, job.slots[:n], tenant=job.tenant)
        stored = next((i for i, ok in enumerate(result.ok) if not ok), len(result.ok))
        self.in_l3.update(job.hashes[:stored])
        self.acks.count(l3_stored_pages=stored)
        return stored

    def _prefetch(self, job: Job) -> int:
        """Read the job's pages into its slots; slots a late call may still write into are
        reported held."""
        ok = [not self.reading[s] for s in job.slots]
        n = next((i for i, fine in enumerate(ok) if not fine), len(ok))
        if n < len(ok):
            self.acks.violation("prefetch into a slot a backup reads", job.slots[n:], [False] * (len(ok) - n))
        started = time.perf_counter()
        result = self.store.prefetch(job.hashes[:n], self.host, job.slots[:n], tenant=job.tenant)
        if n:       # a read given up on at its deadline cost the request that long
            self.acks.read(n, time.perf_counter() - started)
        for slot, page in zip(job.slots[:result.pages], job.hashes):
            self.pages[slot] = (page, job.tenant)
        self.in_l3.update(job.hashes[:result.pages])
        if result.late:
            held = job.slots[result.pages:n]
            remaining = [len(result.late)]

            def returned() -> None:
                with self._lock:
                    remaining[0] -= 1
                    last = not remaining[0]
                if last:
                    self.acks.release(held)
            self.acks.hold(held)
            for call in result.late:
                call.when_returned(returned)
        self.acks.count(l3_read_pages=result.pages)
        return result.pages

    # -- shutdown ----------------------------------------------------------------------------

    def write_back(self, unlanded: set[int]) -> None:
        """The host tier's pages L3 lacks, one backup a tenant, before the flush waits; never a
        slot whose save has not landed (`unlanded`), nor one a backup already reads (so a second
        call adds only what landed since)."""
        by_tenant: dict[bytes, list[tuple[str, int]]] = {}
        for slot, (page, tenant) in self.pages.items():
            if page not in self.in_l3 and not self.reading[slot] and slot not in unlanded:
                by_tenant.setdefault(tenant, []).append((page, slot))
        for tenant, pages in by_tenant.items():
            self.start("backup", Job(next(_FLUSH_JOBS), [h for h, _ in pages], tenant, [s for _, s in pages]))

    def flush(self, timeout: float) -> None:
        """Wait up to `timeout` for the jobs under way; those left are cancelled, their threads
        abandoned: the process exits now."""
        shutdown.flush(self._running, timeout)
        if self._running:
            self._portal.call(self._portal.stop, True)
