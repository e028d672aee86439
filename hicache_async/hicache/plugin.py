"""HiCachePlugin: the scheduler-facing side of the tiered cache.

The scheduler calls `admit`, `layer_ready`, `finish` and, once per iteration, `on_step`,
inside `async with plugin:`, which owns the storage workers. Ops are issued synchronously
from those calls into the step ledger; their completion is only acted on in `on_step`,
which reaps, offers, agrees, retires and dispatches, in that order.
"""
from __future__ import annotations

import time

import anyio
from anyio.abc import TaskGroup

from ..api import EngineContext, KVPlugin
from ..config import CacheConfig
from ..errors import UsageError
from ..events import first_completion
from ..kinds import TransferKind
from ..parallel.agreement import Agreement, LocalAgreement
from ..pools import HostPool
from ..request import Request
from ..telemetry import spans
from ..transfer.l3_session import guarded_store
from ..transfer.page_store import StoreCounters
from .admission import Admissions
from .cache import TieredCache
from .ledger import Ledger, StepMessage
from .op_tracing import OpTracer
from .prefetch_cost import PrefetchCost
from .storage_tier import StorageTier


class HiCachePlugin(KVPlugin):
    def __init__(self, config: CacheConfig | None = None, storage=None, storage_name: str = "none",
                 agreement: Agreement | None = None) -> None:
        self.config = config or CacheConfig()
        self.storage, self.storage_name = storage, storage_name
        self.agreement = agreement or LocalAgreement()
        self._solo = self.agreement.ranks == 1    # nobody to agree with: an idle step is free
        self.step = 0
        self.step_us: list[float] = []
        self.most_pending_sends = 0
        self.tracer: OpTracer | None = None     # from attach: it needs the engine's placement
        self.ledger: Ledger | None = None
        self.cache: TieredCache | None = None
        self.l3: StorageTier | None = None
        self._tasks: TaskGroup | None = None    # while entered: owns the storage workers

    def attach(self, engine: EngineContext) -> None:
        self.engine = engine
        cfg, coords = self.config, engine.coords
        if self.agreement.ranks != coords.world_size:
            raise UsageError(f"{coords.label()}: a world of {coords.world_size} ranks needs a cross-rank "
                             f"agreement over all of them (pass agreement=PipelineAgreement(...)); this "
                             f"one spans {self.agreement.ranks} and would let rank trees diverge")
        if engine.layout.page_size != cfg.page_size:
            raise UsageError(f"engine page size {engine.layout.page_size} != cache page size {cfg.page_size}")
        self.tracer = OpTracer(engine.run_id, coords, cfg.key_scheme)
        self.ledger = Ledger(self.tracer, engine.clock, cfg.sync_timeout_s)
        self.cache = TieredCache(cfg, engine.device, HostPool(engine.layout, cfg.host_pages), self.ledger)
        if self.storage is not None:
            store = guarded_store(self.storage, self.storage_name, engine.layout, coords, cfg)
            self.l3 = StorageTier(self.cache, store, cfg, self._tasks)
        self.prefetch_cost = PrefetchCost(engine.layout, coords, prefill_us_per_token=cfg.prefill_us_per_token,
                                          l3_gbps=cfg.l3_gbps, l3_latency_us=cfg.l3_latency_us,
                                          threshold_tokens=cfg.prefetch_threshold, clock=engine.clock)
        self.admissions = Admissions(cfg, self.cache, self.l3, self.prefetch_cost, self.tracer)
        self._gives_up = self.l3.gives_up if self.l3 is not None else _never

    # -- requests ---------------------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        return self.admissions.admit(req)

    def fetching(self, req: Request) -> bool:
        """Whether `req` waits for an L3 prefetch, so that `admit` only marks it wanted."""
        return self.admissions.fetching(req)

    async def layer_ready(self, reqs: list[Request], layer: int) -> None:
        await self.admissions.layer_ready(reqs, layer)

    def finish(self, req: Request) -> None:
        self.admissions.finish(req)

    def kv_origin(self, req: Request) -> list[str]:
        return self.admissions.kv_origin(req)

    def busy(self) -> bool:
        return self.ledger.busy()

    async def wait_progress(self, timeout_s: float) -> None:
        """Return once this rank could retire an op, or after `timeout_s` at most.

        An idle loop awaits this between steps instead of spinning through them. Only the
        head of each queue matters (ops retire in order), so it awaits the heads' completion
        events, and a prefetch head's policy deadline. It returns at once when this rank has
        something ready even if other ranks do not: the next step's agreement waits for them.
        """
        if self.ledger.ready_any():
            return
        if self.l3 is not None:
            timeout_s = min(timeout_s, max(0.0, self.l3.next_deadline() - self.ledger.clock.now()))
        await first_completion(self.ledger.heads(), timeout_s)

    # -- the per-step hook ----------------------------------------------------------------

    async def on_step(self) -> None:
        """Reap -> offer -> agree -> retire -> dispatch."""
        start = time.perf_counter()
        self.step += 1
        if self._solo and not self.busy() and not self.ledger.quarantine:
            self.step_us.append((time.perf_counter() - start) * 1e6)
            return
        self.tracer.begin_step(self.step)
        await self.agreement.reap()
        offer = await self.ledger.offer(self.step, self._gives_up, self.prefetch_cost.offer())
        with spans.pp_sync_span(self.engine.coords, parent=self.tracer.step_span) as span:
            world = StepMessage.L3 if self.ledger.l3_active() else None
            agreed = StepMessage.unpack(await self.agreement.agree(offer.pack(), self.ledger.digest, self.step, world))
            if span.is_recording():
                span.set_attributes({"hicache.step": self.step, "hicache.agreed": agreed.pack()})
        self.prefetch_cost.agreed(agreed.l3_kbps)
        self._dispatch(await self.ledger.retire(agreed, self.step))
        self.most_pending_sends = max(self.most_pending_sends, self.agreement.pending_sends)
        self.step_us.append((time.perf_counter() - start) * 1e6)

    def _dispatch(self, retired: dict[TransferKind, list]) -> None:
        """Hand each tier the ops every rank retired; retired writes are due for backup."""
        writes = retired[TransferKind.WRITE]
        self.cache.retired(writes + retired[TransferKind.LOAD])
        if self.l3 is None:
            return
        self.l3.back_up(writes)
        prefetches = retired[TransferKind.PREFETCH]
        self.l3.retired(retired[TransferKind.BACKUP], prefetches)
        for op in prefetches:
            self.prefetch_cost.observe(getattr(op.result, "bytes", 0), op.seconds)
            self.admissions.prefetched(op)

    def report(self) -> dict:
        counters = self.l3.store.counters if self.l3 else StoreCounters()
        return {**self.admissions.stats, "transfers": dict(self.tracer.transfers), "steps": self.step,
                "digest": self.ledger.digest, "storage_errors": self.l3.errors if self.l3 else 0,
                "corrupt_objects": counters.corrupt_objects, "missing_objects": counters.missing_objects,
                "forged_objects": counters.forged_objects, "healed_objects": counters.healed_objects,
                "quarantined_bytes": self._quarantined_bytes(counters),
                "l3_bytes_written": counters.bytes_written, "l3_bytes_read": counters.bytes_read,
                "dropped_pages": self.cache.dropped_pages, "most_pending_sends": self.most_pending_sends,
                "prefetches_terminated": self.l3.terminated if self.l3 else 0,
                "l3_pages_from_before": self.l3.earlier_pages if self.l3 else 0,
                "pp_sync": self.agreement.counts(), "miss_reasons": self.admissions.misses,
                "step_us": self.step_us}

    def _quarantined_bytes(self, counters: StoreCounters) -> int:
        """Memory that calls given up on may still write into: staging and held host pages."""
        return counters.quarantined_bytes + self.ledger.quarantine.late_pages() * self.cache.host.layout.page_bytes

    # -- lifetime ---------------------------------------------------------------------------

    async def __aenter__(self) -> HiCachePlugin:
        """Open the task group that owns the storage workers (attach may come before or after)."""
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        if self.l3 is not None:
            self.l3.tasks = self._tasks
        return self

    async def __aexit__(self, *exc_info) -> None:
        """Cancel storage work still in flight (running prefetches are told to stop first) and
        give back what it held; join the copy workers and flush the pipeline sends, off the
        event loop so its other tasks (telemetry, peers) keep running. An error from the
        body propagates as it was, not wrapped in an exception group."""
        if self.tracer is not None:
            self.tracer.end()
        try:
            if self.l3 is not None:
                self.l3.stop()
            self._tasks.cancel_scope.cancel()
            await self._tasks.__aexit__(None, None, None)
        finally:
            self._tasks = None
            with anyio.CancelScope(shield=True):     # an outer cancellation must not skip these
                if self.l3 is not None:
                    self.l3.tasks = None
                    self.l3.abandon()
                if self.cache is not None:
                    await anyio.to_thread.run_sync(self.cache.close)
                await self.agreement.close()


def _never(op) -> bool:
    """No L3: no prefetch for a policy to give up on."""
    return False
