"""The worker side: carries out each step's plan on this rank's share of the KV.

Copies between vLLM's blocks and the host pool go through the core's copy engine
(`BlockCopies`): a few launches a layer on a GPU, each batch completing on an event. Loads run
layer by layer beside the forward pass; saves are issued after it and never waited for: each
plan's copies are reported landed once their events are (`reports`), and only then does the
scheduler let a backup read a saved slot or reuse a loaded one. A finished request's blocks
stay with vLLM until its saves landed (`finished_sending`); a preempted one's saves are issued,
and ordered before any kernel that may reuse its blocks, before its blocks are reused
(`preempted`).

A copy that fails is never taken for KV: a save whose event carries an error, or whose page
was computed over a block that a load of its step refused or failed to fill, is dropped here
and reported `failed`, and the scheduler frees its slot on every worker (no announcement, no
backup); a failed load's blocks are load errors, which vLLM recomputes.

L3 work runs in the background (`l3_jobs.py`). A prefetch starts as its plan is bound, before
the forward pass, so a read shorter than the pass is reported with the pass and its request
waits one step, not two. What the worker has yet to report, and its counts, are its acks
(`acks.py`). The worker checks the slot rules it can see (a write into a slot a backup reads, a
load from a slot that holds another page) and drops such pages; the count is
`slot_violations`, zero unless the scheduler is wrong.
"""
from __future__ import annotations

import atexit
import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import structlog

from hicache_async.errors import StorageError
from hicache_async.events import CompletionEvent
from hicache_async.kinds import TransferKind
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.telemetry import spans
from hicache_async.telemetry.sdk import setup_telemetry
from hicache_async.topology import RankCoords
from hicache_async.transfer.block_copies import BlockCopies
from hicache_async.transfer.l3_session import l3_session
from hicache_async.transfer.sim_device import SimDevice

from . import shutdown
from .acks import Acks
from .l3_jobs import L3Jobs
from .plan import Job, JobReports, Move, StepPlan
from .settings import Settings
from .observed import OBSERVED

log = structlog.get_logger(__name__)
FENCE_TIMEOUT_S = 60.0  # longest a preemption waits for its saves to be issued: then the engine stops


@dataclass
class PlanCopies:
    """A plan's copies on this worker, until they land."""

    step: int
    load: CompletionEvent | None
    save: CompletionEvent | None
    loaded: list[int]                                   # blocks its loads fill
    saved: set[int]                                     # slots its saves fill
    saves: Counter = field(default_factory=Counter)     # saves a request
    chained: list[Job] = field(default_factory=list)    # backups that follow its saves


class WorkerSide:
    def __init__(self, settings: Settings, layout: KVLayout, coords: RankCoords, kv: list) -> None:
        self.settings, self.layout, self.coords = settings, layout, coords
        if not spans.tracing_enabled():     # OTLP as the OTEL_* variables say; vLLM keeps its logs
            setup_telemetry(service_name="hicache-vllm", coords=coords, logs=False)
        self.host = HostPool(layout, settings.host_pages)
        self.copies = BlockCopies(kv, self.host, device=self._simulated_device())
        self.pages: dict[int, tuple[str, bytes]] = {}    # slot -> (page, tenant) it holds or is filled with
        self.acks = Acks(synchronous=int(not self.copies.streamed and not settings.late_copies))
        self._stack = contextlib.ExitStack()
        store = self._open_store(coords) if settings.storage != "none" else None
        self.jobs = L3Jobs(self._stack, store, self.host, self.pages, self.acks, self._span)
        self._landing: list[PlanCopies] = []             # in plan order
        self._step = 0                                   # the latest plan seen (late_copies lands only older ones)
        self._saving: Counter[str] = Counter()           # per request: plans whose saves have not landed
        self._keep: set[str] = set()                     # finished requests whose blocks vLLM keeps for us
        self._load_errors: set[int] = set()              # vLLM blocks a load could not fill, to report
        self._bad: set[int] = set()                      # ...and those of this step's loads, for its saves
        self._loaded: list[int] = []                     # blocks this step's loads fill
        self._began: float | None = None                 # when the bound plan's forward pass began
        self._load_span = None
        self._load_event = None                          # this step's loads, landed on it
        self._closed = False
        atexit.register(self.close)     # vLLM's in-process engine may exit without a shutdown call
        if kv[0].is_cuda:
            log.info("hicache: vLLM captures piecewise CUDA graphs: layer-by-layer loads wait beside attention, "
                     "which a full graph would replay without them")
        if store is not None:       # each L3 read and write timed, for the stats (stats.py, shutdown.py)
            store.adapter = OBSERVED.timed(store.adapter, self.backup_queue)
            shutdown.on_signals(settings.flush_timeout)

    def _simulated_device(self) -> SimDevice | None:
        """`simulated_device`: the GPU's copy path (streams, events, DMA) over CPU KV, for tests."""
        if self.settings.simulated_device is None:
            return None
        device = SimDevice(seed=self.settings.simulated_device)
        device.register(self.host)
        return device

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

    def begin(self, plan: StepPlan) -> None:
        """The plan is bound, its forward pass about to run: the pass is timed from here, and
        its prefetches start now, reading beside the pass."""
        self._began = time.perf_counter()
        self.jobs.start_prefetches(plan)

    def start(self, plan: StepPlan) -> None:
        """Before the forward pass: this step's loads start (on a GPU; on a CPU each layer is
        copied when its attention asks). Where vLLM took back a block a save still reads (a
        sliding window moved on), the saves issued land before any copy or kernel of this step;
        blocks vLLM counts loaded that no load fills are load errors: recomputed, never stale."""
        self._step = plan.step
        if plan.fence:
            self.copies.fence_saves(FENCE_TIMEOUT_S)
        self._load_errors.update(plan.unfilled)
        self._bad.update(plan.unfilled)
        loads = [self._loadable(move) for move in plan.loads]
        self._load_span = self._moves_span(TransferKind.LOAD, loads)
        slots, self._loaded = _flat(loads)
        self._load_event = self.copies.load(slots, self._loaded) if slots else None
        self.acks.count(host_loaded_pages=len(slots))

    def _loadable(self, move: Move) -> Move:
        """The move without slots that do not hold its pages here: their blocks become load
        errors (vLLM recomputes them) rather than another page's bytes."""
        ok = [self.pages.get(s, ("",))[0] == p for s, p in zip(move.slots, move.pages)]
        if all(ok):
            return move
        self.acks.violation("load from a slot that holds another page", move.slots, ok)
        for slot in (s for s, fine in zip(move.slots, ok) if not fine):
            self.pages.pop(slot, None)      # it holds no page we can name
        self._bad.update(b for b, fine in zip(move.blocks, ok) if not fine)
        self._load_errors.update(self._bad)
        return move.keeping(ok)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_layer(self, layer: int) -> None:
        self.copies.wait_layer(layer)

    def finish(self, plan: StepPlan) -> None:
        """After the forward pass: saves are issued (not waited for), then the L3 work. A save
        whose page was computed over a block this step's loads did not fill right is dropped."""
        began, self._began = self._began, None
        if began is not None and plan.tokens and not plan.idle:
            self.acks.passes.append((plan.tokens, time.perf_counter() - began))
        self._step = plan.step
        self.copies.wait_loads()
        if self._load_span is not None:
            spans.finish_transfer(self._load_span)
            self._load_span = None
        load, self._load_event = self._load_event, None
        loaded, self._loaded, bad, self._bad = self._loaded, [], self._bad, set()
        if load is not None and load.query() and load.error is not None:
            self._failed_load(load.error, loaded)
            bad.update(loaded)
            load = None
        saves = self._kept_saves(plan, bad)
        slots, blocks = _flat(saves)
        for move in saves:
            for slot, page in zip(move.slots, move.pages):
                self.pages[slot] = (page, move.tenant)
        chained = [job for job in plan.backups if job.after_save]
        if plan.copies:
            save = self.copies.save(slots, blocks) if slots else None
            self._landing.append(PlanCopies(plan.step, load, save, loaded, set(slots),
                                            Counter(m.req_id for m in saves), chained))
            self._saving.update(m.req_id for m in saves)
        span = self._moves_span(TransferKind.WRITE, saves)
        if span is not None:
            spans.finish_transfer(span)
        self.acks.count(host_saved_pages=len(slots))
        for job in plan.backups:
            if not job.after_save:
                self.jobs.start("backup", job)
        self._land()
        self.jobs.start_prefetches(plan)
        if plan.idle:
            self.jobs.await_prefetch()

    def _kept_saves(self, plan: StepPlan, bad: set[int]) -> list[Move]:
        """The plan's saves this worker makes: none computed over a `bad` block (one a load of
        this step refused or failed to fill) nor into a slot a backup here reads. Any dropped
        marks the plan failed: its pages then hold on no worker's word."""
        saves = [move.before(bad) for move in plan.saves]
        spoiled = set(_flat(plan.saves)[0]) - set(_flat(saves)[0])
        if spoiled:
            self._drop_saves(plan.step, spoiled, "computed over a block whose load failed")
        saves = [self._writable(move) for move in saves]
        if _pages(saves) < _pages(plan.saves):
            self.acks.failed[plan.step] = 1
        return saves

    def preempted(self, plan: StepPlan) -> None:
        """Before the forward pass: vLLM gives a preempted request's blocks to another, so its
        saves still in flight are issued now and every later kernel of the forward pass waits
        for them (`fence_saves`); they land, and are reported, as any other. Never a timeout
        into another request's KV: a fence that cannot be set stops the engine."""
        self._land()
        if any(self._saving[r] for r in plan.preempted):
            self.copies.fence_saves(FENCE_TIMEOUT_S)
            self.acks.count(fenced_preemptions=1)

    def _drain(self, timeout: float) -> None:
        """Wait, bounded, for every copy issued to land, and its chained backups to start."""
        deadline = time.monotonic() + timeout
        self._land()
        while self._landing and time.monotonic() < deadline:
            time.sleep(0.001)
            self._land()

    def finished_sending(self, plan: StepPlan) -> set[str]:
        """Finished requests whose saves all landed (or failed) here: vLLM may free their blocks."""
        self._step = max(self._step, plan.step)
        self._keep.update(plan.keep)
        self._land()
        done = {r for r in self._keep if not self._saving[r]}
        self._keep -= done
        return done

    def _land(self) -> None:
        """Plans whose copies' events completed, in order (under `late_copies`, only once a
        later plan came): reported, their saves no longer pending, and the backups that follow
        them started (none from a slot not saved here). A failed copy drops the plan's saves."""
        while self._landing and self._landed(self._landing[0]):
            c = self._landing.pop(0)
            failure = next((e.error for e in (c.load, c.save) if e is not None and e.error is not None), None)
            if c.load is not None and c.load.error is not None:
                self._failed_load(c.load.error, c.loaded)
            if failure is not None and c.saved:
                self._drop_saves(c.step, c.saved, f"copy failed: {failure}")
                c.saved = set()
            self.acks.copied[c.step] += 1
            self._saving -= c.saves
            for job in c.chained:
                if c.saved.issuperset(job.slots):
                    self.jobs.start("backup", job)
                else:       # a save dropped here: nothing of ours to store, nothing read
                    self.acks.ended(job.job, 0)

    def _unlanded(self) -> set[int]:
        """Slots this worker saves into whose copies have not landed."""
        return {slot for c in self._landing for slot in c.saved}

    def _landed(self, c: PlanCopies) -> bool:
        late = self.settings.late_copies and c.step >= self._step
        return not late and all(e.query() for e in (c.load, c.save) if e is not None)

    def _failed_load(self, error: BaseException, blocks: list[int]) -> None:
        """A load's copy failed: its blocks are load errors, which vLLM recomputes."""
        log.warning("hicache: a load failed; vLLM recomputes its blocks", blocks=len(blocks), error=str(error))
        self._load_errors.update(blocks)

    def _drop_saves(self, step: int, slots: set[int], why: str) -> None:
        """The plan's saves into `slots` hold nothing here: forgotten, reported failed, so the
        scheduler frees their slots on every worker."""
        log.warning(f"hicache: saved pages dropped ({why}); their slots are freed", step=step, pages=len(slots))
        for slot in slots:
            self.pages.pop(slot, None)
        self.acks.failed[step] = 1
        self.acks.count(failed_saves=len(slots))

    def _writable(self, move: Move) -> Move:
        """The move without slots a backup here still reads (never, if the scheduler is right)."""
        ok = [not self.jobs.reading[s] for s in move.slots]
        if all(ok):
            return move
        self.acks.violation("write into a slot a backup reads", move.slots, ok)
        return move.keeping(ok)

    def _moves_span(self, kind: TransferKind, moves: list):
        """The span of a step's loads or saves; None when there are none."""
        return self._span(kind, _pages(moves), (m.req_id for m in moves)) if _pages(moves) else None

    def _span(self, kind: TransferKind, pages: int, req_ids):
        """A transfer's span, named by vLLM's request ids."""
        req_ids = sorted(set(req_ids))
        return spans.start_transfer(kind, pages=pages, nbytes=pages * self.layout.page_bytes, coords=self.coords,
                                    key_scheme=self.settings.key_scheme, attrs={"vllm.request_ids": req_ids})

    def backup_queue(self) -> int:
        """Slots this worker's backups still read: the backup queue's depth, in pages."""
        return len(self.jobs.reading)

    def totals(self) -> dict[str, int]:
        """This worker's counts and its store's (corrupt, forged, missing objects, errors)."""
        totals = self.acks.totals()
        if self.jobs.store is not None:
            c = self.jobs.store.counters
            totals.update(l3_corrupt_objects=c.corrupt_objects, l3_forged_objects=c.forged_objects,
                          l3_missing_objects=c.missing_objects, l3_healed_objects=c.healed_objects,
                          l3_errors=c.storage_errors,
                          l3_bytes_written=c.bytes_written, l3_bytes_read=c.bytes_read)
        return totals

    def reports(self) -> JobReports | None:
        """Plans whose copies landed, finished jobs, slots late reads hold or released, and
        pages the store evicted (no longer in L3, for the flush either)."""
        self._land()
        return self.acks.take(self.jobs.evicted)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Flush, within `flush_timeout`: every save issued lands and starts the backups that
        follow it, then, under write_back, the host tier's landed pages L3 lacks are backed up,
        and the L3 work issued is waited for; what is left is cancelled and counted in one
        line each. Then the copy engine stops, the store closes and the pool is unpinned.
        Once: later calls do nothing."""
        atexit.unregister(self.close)
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.settings.flush_timeout
        write_back = self.jobs.store is not None and self.settings.write_policy == "write_back"
        self._step = math.inf       # no later plan comes: every copy may land now
        if write_back:              # the landed pages first: a save that never lands must not starve them
            self.jobs.write_back(self._unlanded())
        self._drain(self.settings.flush_timeout)
        unlanded = sum(len(c.saved) for c in self._landing)
        if unlanded:
            log.warning("hicache shutdown: saves not landed after flush_timeout; their pages are not in L3",
                        pages=unlanded, flush_timeout=self.settings.flush_timeout)
        if write_back:              # and those that landed meanwhile
            self.jobs.write_back(self._unlanded())
        self.jobs.flush(max(0.0, deadline - time.monotonic()))
        self._stack.close()
        self.copies.close()
        self.host.close()


def _flat(moves: list[Move]) -> tuple[list[int], list[int]]:
    """Every move's host slots and vLLM blocks, in order."""
    return [s for m in moves for s in m.slots], [b for m in moves for b in m.blocks]


def _pages(moves: list) -> int:
    return sum(len(m.slots) for m in moves)
