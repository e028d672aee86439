"""The worker side: carries out each step's plan on this rank's share of the KV.

Copies between vLLM's blocks and the host pool run on the step's own thread (a CUDA copy
stream on a GPU), loads layer by layer as the forward pass asks for them. L3 work runs in the
background on an anyio event loop of the worker's own (a blocking portal), its storage calls
on worker threads under one capacity limiter per kind; each finished job is reported once.
A prefetch reads straight into the host slots the scheduler held for it, no page's yet, so a
verified page is in its slot with no copy; an L3 call given up on may still write into the
slots past the verified run, and they are reported held until it returns, so the scheduler
gives them to no page before then and late bytes never reach a page vLLM reads. A slot a
backup still reads is not written until it is done (`SlotReaders`); loads only read slots,
so they never wait for backups.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait

import anyio
import anyio.from_thread
import structlog

from hicache_async.errors import StorageError
from hicache_async.kinds import TransferKind
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.telemetry import spans
from hicache_async.telemetry.sdk import setup_telemetry
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import l3_session

from . import shutdown
from .layer_copies import LayerCopies
from .plan import Job, JobReports, Move, StepPlan
from .settings import Settings
from .slot_readers import SlotReaders
from .stats import OBSERVED

log = structlog.get_logger(__name__)
IDLE_WAIT_S = 0.05  # longest an engine step with no forward pass waits for a prefetch


class WorkerSide:
    def __init__(self, settings: Settings, layout: KVLayout, coords: RankCoords, kv: list) -> None:
        self.settings, self.layout, self.coords = settings, layout, coords
        if not spans.tracing_enabled():     # OTLP as the OTEL_* variables say; vLLM keeps its logs
            setup_telemetry(service_name="hicache-vllm", coords=coords, logs=False)
        self.host = HostPool(layout, settings.host_pages)
        self.copies = LayerCopies(kv, self.host)
        self._stack = contextlib.ExitStack()
        self.store = self._open_store(coords) if settings.storage != "none" else None
        self._portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        self._limiters = {kind: self._portal.call(anyio.CapacityLimiter, 2) for kind in ("backup", "prefetch")}
        self._lock = threading.Lock()
        self.readers = SlotReaders()
        self._load_errors: set[int] = set()             # vLLM blocks a load could not fill
        self._held: Counter[int] = Counter()            # slots late reads may write: to report...
        self._released: Counter[int] = Counter()        # ...and those whose late reads returned
        self._finished: dict[int, int] = {}            # job -> pages, not yet reported
        self._running: set[Future] = set()
        self._prefetching: set[Future] = set()
        self._load_span = None
        self.counts = {"host_loaded_pages": 0, "host_saved_pages": 0, "l3_stored_pages": 0, "l3_read_pages": 0}
        atexit.register(self.close)     # vLLM's in-process engine may exit without a shutdown call
        if self.store is not None:      # each L3 read and write timed, for the stats (stats.py, shutdown.py)
            self.store.adapter = OBSERVED.timed(self.store.adapter, self.readers.busy)
            shutdown.on_signals(settings.flush_timeout)

    def _open_store(self, coords: RankCoords):
        s = self.settings
        try:
            return self._stack.enter_context(l3_session(
                s.storage, s.storage_options(), self.layout, coords, s.cache_config(),
                secret_file=s.storage_secret_file, head_group=s.head_group))
        except StorageError as exc:
            if not s.storage_optional:
                raise
            log.warning("hicache: L3 unreachable at start; serving from the host tier alone", error=str(exc))
            return None

    # -- the step ------------------------------------------------------------------------

    def start(self, plan: StepPlan) -> None:
        """Before the forward pass: evictions leave for L3, finished prefetches land in their
        slots, and this step's loads start."""
        for job in plan.evictions:
            self._background("backup", job)
        loads = [self._loadable(move) for move in plan.loads]
        self._load_span = self._moves_span(TransferKind.LOAD, loads)
        self.copies.load(loads)
        self._count(host_loaded_pages=_pages(loads))

    def _loadable(self, move: Move) -> Move:
        """The move without its stale slots, whose blocks become load errors: vLLM
        recomputes them rather than read another page's bytes."""
        stale = self.readers.stale
        if not stale.intersection(move.slots):
            return move
        self._load_errors.update(b for s, b in zip(move.slots, move.blocks) if s in stale)
        return move.keeping([s not in stale for s in move.slots])

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_layer(self, layer: int) -> None:
        self.copies.wait_layer(layer)

    def finish(self, plan: StepPlan) -> None:
        """After the forward pass: saves, then the L3 work they start."""
        self.copies.wait_all()
        if self._load_span is not None:
            spans.finish_transfer(self._load_span)
            self._load_span = None
        saves = [self._writable(move) for move in plan.saves]
        span = self._moves_span(TransferKind.WRITE, saves)
        self.copies.save(saves)
        for move in saves:
            self.readers.written(move.slots)
        if span is not None:
            spans.finish_transfer(span)
        self._count(host_saved_pages=_pages(saves))
        for job in plan.backups:
            self._background("backup", job)
        for job in plan.prefetches:
            self._prefetching.add(self._background("prefetch", job))
        if plan.idle:
            self._await_prefetch()

    def _await_prefetch(self) -> None:
        """An engine step with no forward pass has only L3 to wait for: wait (a little) for a
        prefetch to finish, so its report goes out this step, instead of spinning through empty
        steps that hold the GIL while the reading thread needs it."""
        self._prefetching = {f for f in self._prefetching if f is not None and not f.done()}
        if self._prefetching:
            wait(self._prefetching, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)

    def _writable(self, move: Move) -> Move:
        """The move without the slots whose readers outlast the deadline (now stale)."""
        ok = self.readers.writable(move.slots, self.settings.storage_timeout)
        if all(ok):
            return move
        log.warning("hicache: host slots still read by a backup past the deadline; their pages are dropped",
                    slots=[s for s, fine in zip(move.slots, ok) if not fine])
        return move.keeping(ok)

    def _moves_span(self, kind: TransferKind, moves: list):
        """The span of a step's loads or saves; None when there are none."""
        return self._span(kind, _pages(moves), (m.req_id for m in moves)) if moves else None

    def _span(self, kind: TransferKind, pages: int, req_ids):
        """A transfer's span, named by vLLM's request ids."""
        req_ids = sorted(set(req_ids))
        return spans.start_transfer(kind, pages=pages, nbytes=pages * self.layout.page_bytes, coords=self.coords,
                                    key_scheme=self.settings.key_scheme, attrs={"vllm.request_ids": req_ids})

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self.counts[name] += n

    def totals(self) -> dict[str, int]:
        """This worker's counts and its store's (corrupt, forged, missing objects, errors)."""
        with self._lock:
            totals = dict(self.counts)
        if self.store is not None:
            c = self.store.counters
            totals.update(l3_corrupt_objects=c.corrupt_objects, l3_forged_objects=c.forged_objects,
                          l3_missing_objects=c.missing_objects, l3_healed_objects=c.healed_objects,
                          l3_errors=c.storage_errors,
                          l3_bytes_written=c.bytes_written, l3_bytes_read=c.bytes_read)
        return totals

    def reports(self) -> JobReports | None:
        """Finished jobs, and the slots that turned stale since the last report (the scheduler
        forgets their pages, once)."""
        with self._lock:
            done, self._finished = self._finished, {}
            held, self._held = self._held, Counter()
            released, self._released = self._released, Counter()
        stale = self.readers.newly_stale()
        if not (done or stale or held or released):
            return None
        return JobReports({job: (1, pages) for job, pages in done.items()}, stale, held, released)

    # -- L3 --------------------------------------------------------------------------------

    def _background(self, kind: str, job: Job) -> Future | None:
        if self.store is None:      # nothing to do, but the scheduler waits for every job
            with self._lock:
                self._finished[job.job] = 0
            return None
        run = self._backup if kind == "backup" else self._prefetch
        future = self._portal.start_task_soon(self._in_thread, kind, run, job)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        if kind == "backup":
            self.readers.add(job.slots, future)
        return future

    async def _in_thread(self, kind: str, run, job: Job) -> None:
        span = self._span(TransferKind(kind), len(job.hashes), job.req_ids)
        error = None
        try:
            pages = await anyio.to_thread.run_sync(run, job, limiter=self._limiters[kind])
        except Exception as exc:    # noqa: BLE001 - a failed job is a miss, never a crash
            log.warning("hicache L3 job failed; its pages are a miss", kind=kind, job=job.job, error=str(exc))
            pages, error = 0, exc
        spans.finish_transfer(span, error=error, attrs={"hicache.pages_done": pages})
        with self._lock:
            self._finished[job.job] = pages

    def _backup(self, job: Job) -> int:
        result = self.store.backup(job.hashes, self.host, job.slots, tenant=job.tenant)
        stored = next((i for i, ok in enumerate(result.ok) if not ok), len(result.ok))
        self._count(l3_stored_pages=stored)
        return stored

    def _prefetch(self, job: Job) -> int:
        """Read the job's pages into its slots, up to the first slot a backup still reads
        past the deadline; slots a late call may still write into are reported held."""
        ok = self.readers.writable(job.slots, self.settings.storage_timeout)
        n = next((i for i, fine in enumerate(ok) if not fine), len(ok))
        result = self.store.prefetch(job.hashes[:n], self.host, job.slots[:n], tenant=job.tenant)
        self.readers.written(job.slots[:result.pages])
        if result.late:
            held = job.slots[result.pages:n]
            remaining = [len(result.late)]

            def returned() -> None:
                with self._lock:
                    remaining[0] -= 1
                    if not remaining[0]:
                        self._released.update(held)
            with self._lock:
                self._held.update(held)
            for call in result.late:
                call.when_returned(returned)
        self._count(l3_read_pages=result.pages)
        return result.pages

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Flush: wait, bounded, for the L3 work already issued, so a request's KV is in L3
        when the engine exits; then close the store. Once: later calls do nothing."""
        atexit.unregister(self.close)
        shutdown.flush(self._running, self.settings.flush_timeout)
        self._stack.close()


def _pages(moves: list) -> int:
    return sum(len(m.slots) for m in moves)
