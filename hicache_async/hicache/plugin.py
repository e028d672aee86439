"""HiCachePlugin: the scheduler-facing side of the tiered cache.

The scheduler calls `admit`, `layer_ready`, `finish` and, once per iteration, `on_step`.
Ops are issued synchronously from those calls; their completion is only acted on in
`on_step`, after every rank agreed how many of each queue to retire.
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import anyio

from ..telemetry import spans
from ..parallel.agreement import BACKUP, L3_KBPS, LOAD, PAGES, PREFETCH, WRITE, LocalAgreement, pack
from .cache import TieredCache
from ..config import CacheConfig
from ..errors import PoolExhausted, UsageError
from ..transfer.events import first_completion
from ..keys import make_key_scheme, page_hashes
from .op_tracing import OpTracer
from .ops import ROUTES, AckQueue, CacheOp
from ..transfer.page_store import PageStore, StoreCounters
from ..api import EngineContext, KVPlugin
from .prefetch_cost import Decision, PrefetchCost
from ..transfer.pool import HostPool
from ..request import Request
from ..storage.guarded import GuardedStorage
from ..storage.traced import TracedStorage
from .storage_tier import StorageTier
from ..transfer.copier import CopyFailed


class HiCachePlugin(KVPlugin):
    def __init__(self, config: CacheConfig | None = None, storage=None, storage_name: str = "none",
                 agreement=None) -> None:
        self.config = config or CacheConfig()
        self.storage, self.storage_name = storage, storage_name
        self.agreement = agreement or LocalAgreement()
        self.step = 0
        self.step_us: list[float] = []
        self.stats = {"prompt_tokens": 0, "tokens_from_l1": 0, "tokens_from_l2": 0,
                      "tokens_from_l3": 0, "tokens_computed": 0}
        self.transfers = {kind: 0 for kind in ROUTES}
        self._prefetching: dict[int, Request] = {}
        self._origins: dict[int, list[str]] = {}     # request id -> tier of each cached page
        self._decisions: dict[int, Decision] = {}    # request id -> its L3 prefetch decision
        self.most_pending_sends = 0
        self.tracer: OpTracer | None = None     # from attach: it needs the engine's placement
        self.prefetches_terminated = 0   # by this rank's policy clock, before they finished

    def attach(self, engine: EngineContext) -> None:
        self.engine = engine
        cfg = self.config
        if engine.coords.world_size > 1 and isinstance(self.agreement, LocalAgreement):
            raise UsageError(f"{engine.coords.label()}: a world of {engine.coords.world_size} ranks needs a "
                             f"cross-rank agreement (pass agreement=PipelineAgreement(...)); a local one "
                             f"would let rank trees diverge")
        if engine.layout.page_size != cfg.page_size:
            raise UsageError(f"engine page size {engine.layout.page_size} != cache page size {cfg.page_size}")
        self.tracer = OpTracer(engine.run_id, engine.coords, cfg.key_scheme)
        self.cache = TieredCache(cfg, engine.device, HostPool(engine.layout, cfg.host_pages),
                                 on_issue=self.tracer.issue)
        self.l3 = None
        self._no_l3 = SimpleNamespace(backups=AckQueue("backup"), prefetches=AckQueue("prefetch"))
        if self.storage is not None:
            # Every CP rank holds the full KV of its pages; when only CP rank 0 transfers, the
            # others read the objects it wrote.
            key_coords = (dataclasses.replace(engine.coords, cp_rank=0) if cfg.cp_transfer == "rank0"
                          else engine.coords)
            keys = make_key_scheme(cfg.key_scheme, engine.layout, key_coords)
            guarded = GuardedStorage(self.storage, cfg)   # a dead or hung backend fails fast
            traced = TracedStorage(guarded, engine.coords, self.storage_name)
            store = PageStore(traced, engine.layout, keys, engine.coords, cp_mode=cfg.cp_transfer)
            self.l3 = StorageTier(self.cache, store, cfg)
        self.prefetch_cost = PrefetchCost(engine.layout, engine.coords, prefill_us_per_token=cfg.prefill_us_per_token,
                                          l3_gbps=cfg.l3_gbps, l3_latency_us=cfg.l3_latency_us,
                                          threshold_tokens=cfg.prefetch_threshold)

    # -- admission and completion ------------------------------------------------------------

    def admit(self, req: Request) -> bool:
        if req.prefetch is not None:
            req.prefetch.wanted = True
            return False
        cache, ps = self.cache, self.config.page_size
        need = req.pages_needed(ps)
        if need > self.config.device_pages:
            raise PoolExhausted(f"request {req.id} needs {need} device pages but --device-pages is "
                                f"{self.config.device_pages}")
        tokens = req.prompt[:-1]       # the last prompt token is always computed, for its logits
        match = cache.match(tokens)
        cached_pages = (match.device_tokens + match.host_tokens) // ps
        if self.l3 is not None and not req.prefetched:
            req.prefetched = True
            if self._start_prefetch(req, tokens, match, cached_pages):
                return False
        lock = match.last_node
        with cache.holding(lock):      # the hits must survive the evictions that make room
            fresh = cache.alloc_device(need - len(match.device_pages))
        if fresh is None:
            return False
        cache.tree.lock_device(lock)   # pinned on the device for the request's life
        host_tokens = match.host_tokens
        origin = ["l1"] * len(match.device_pages)
        if match.host_nodes:
            req.loads = [cache.load(match.host_nodes, fresh[: host_tokens // ps], req.id)]
            l3_tokens = sum(n.num_pages for n in match.host_nodes if n.fetched) * ps
            for n in match.host_nodes:
                origin += ["l3" if n.fetched else "l2"] * n.num_pages
                n.fetched = False
            self._count("tokens_from_l3", l3_tokens)
            self._count("tokens_from_l2", host_tokens - l3_tokens)
        req.pages = match.device_pages + fresh
        req.cached = req.kv_len = match.device_tokens + host_tokens
        req.lock = lock
        self._origins[req.id] = origin
        self.tracer.admission(req, match.device_tokens, host_tokens, self._decisions.get(req.id))
        self._count("tokens_from_l1", match.device_tokens)
        self._count("tokens_computed", len(req.prompt) - req.cached)
        self.stats["prompt_tokens"] += len(req.prompt)
        return True

    def _start_prefetch(self, req: Request, tokens: list[int], match, cached_pages: int) -> bool:
        ps = self.config.page_size
        full = len(tokens) // ps
        missing = full - cached_pages
        if missing <= 0:
            return False
        decision = self.prefetch_cost.decide(missing, missing * ps)
        self._decisions[req.id] = decision
        if not decision.fetch:
            return False
        hashes = page_hashes(tokens[: full * ps], ps)
        op = self.l3.prefetch(req.id, match.last_node, tokens[: full * ps], cached_pages, hashes)
        if op is None:
            return False
        if op.span is not None and op.span.is_recording():
            op.span.set_attributes(decision.attributes())
        req.prefetch = op
        self._prefetching[req.id] = req
        return True

    def kv_origin(self, req: Request) -> list[str]:
        return self._origins.get(req.id, [])

    async def layer_ready(self, reqs: list[Request], layer: int) -> None:
        for req in reqs:
            for op in req.loads:
                event = op.events[layer]
                if not event.query():
                    await event.wait(self.config.sync_timeout_s,
                                     f"{self.engine.coords.label()}: load of layer {layer}")
                if event.error is not None:
                    raise CopyFailed(f"{self.engine.coords.label()}: load op of {op.pages} pages for "
                                     f"request {req.id} failed: {event.error}")

    def finish(self, req: Request) -> None:
        ps = self.config.page_size
        full = req.kv_len // ps
        tokens = req.kv_tokens[: full * ps]
        duplicates = self.cache.insert(tokens, req.pages[:full], page_hashes(tokens, ps))
        self.cache.device.alloc.release(duplicates + req.pages[full:])
        self.cache.tree.lock_device(req.lock, -1)
        req.pages, req.loads, req.lock = [], [], None
        self._origins.pop(req.id, None)
        self._decisions.pop(req.id, None)

    def busy(self) -> bool:
        return any(len(q) for q in self._queues())

    def _queues(self) -> tuple[AckQueue, AckQueue, AckQueue, AckQueue]:
        l3 = self.l3 or self._no_l3
        return self.cache.writes, self.cache.loads, l3.backups, l3.prefetches

    async def wait_progress(self, timeout_s: float) -> None:
        """Return once this rank could retire an op, or after `timeout_s` at most.

        An idle loop awaits this between steps instead of spinning through them. Only the
        head of each queue matters (ops retire in order), so it awaits the heads' completion
        events, and a prefetch head's policy deadline. It returns at once when this rank has
        something ready even if other ranks do not: the next step's agreement waits for them.
        """
        queues = self._queues()
        if any(q.ready() for q in queues[:3]) or (self.l3 is not None and self.l3.prefetch_view()[0]):
            return
        heads = [next(iter(q)) for q in queues if len(q)]
        prefetch = next(iter(queues[3]), None)
        if prefetch is not None:
            timeout_s = min(timeout_s, max(0.0, prefetch.deadline - time.monotonic()))
        await first_completion([op.done for op in heads], timeout_s)

    # -- the per-step hook ----------------------------------------------------------------

    async def on_step(self) -> None:
        start = time.perf_counter()
        self.step += 1
        if isinstance(self.agreement, LocalAgreement) and not self.busy():
            self.step_us.append((time.perf_counter() - start) * 1e6)
            return
        self.tracer.begin_step(self.step)
        await self.agreement.reap()
        queues = self._queues()
        writes, loads, backups, prefetches = queues
        n_prefetch, prefetch_pages = self.l3.prefetch_view() if self.l3 else (0, [])
        msg = pack((writes.ready(), loads.ready(), backups.ready(), n_prefetch), prefetch_pages,
                   self.cache.digest, self.prefetch_cost.offer())
        with spans.pp_sync_span(self.engine.coords, parent=self.tracer.step_span) as span:
            agreed = await self.agreement.agree(msg, self.step, l3_pending=len(backups) + len(prefetches) > 0)
            if span.is_recording():
                span.set_attributes({"hicache.step": self.step, "hicache.agreed": agreed})
        self.prefetch_cost.agreed(agreed[L3_KBPS])
        await self._retire(agreed)
        for queue in queues:
            self.tracer.metrics.queue_depth(queue.kind, len(queue))
        self.most_pending_sends = max(self.most_pending_sends, self.agreement.pending_sends)
        self.step_us.append((time.perf_counter() - start) * 1e6)

    async def _retire(self, agreed: list[int]) -> None:
        cache, l3 = self.cache, self.l3
        for op in cache.writes.retire(agreed[WRITE]):
            await self._settle(op)
            cache.release_op(op)
            if l3 is not None:
                l3.backup(op)
        for op in cache.loads.retire(agreed[LOAD]):
            await self._settle(op)
            cache.release_op(op)
        if l3 is None:
            return
        for op in l3.backups.retire(agreed[BACKUP]):
            await self._settle(op)
            l3.retire_backup(op)
        for i, op in enumerate(l3.prefetches.retire(agreed[PREFETCH])):
            if not op.done.query():
                op.cancel.set()      # the policy terminated it: stop the worker, keep what all have
                self.prefetches_terminated += 1
            pages = agreed[PAGES + i]
            op.nbytes = pages * cache.host.layout.page_bytes
            await self._settle(op, {"hicache.pages_committed": pages})
            self.prefetch_cost.observe(getattr(op.result, "bytes", 0), op.seconds)
            l3.retire_prefetch(op, pages)
            self._prefetching.pop(op.request_id).prefetch = None

    async def _settle(self, op: CacheOp, attrs: dict | None = None) -> None:
        """A later stage may retire an op before its own copy finished: await it."""
        if not op.done.query():
            await op.done.wait(self.config.sync_timeout_s,
                               f"{self.engine.coords.label()}: {op.kind} op at step {self.step}")
        if op.done.error is not None:
            raise CopyFailed(f"{self.engine.coords.label()}: {op.kind} op of {op.pages} pages failed: "
                             f"{op.done.error}")
        self.transfers[op.kind] += 1
        self.tracer.retired(op, self.step, attrs)

    def _count(self, stat: str, n: int) -> None:
        self.stats[stat] += n
        if n:
            self.tracer.metrics.tokens(stat.removeprefix("tokens_").removeprefix("from_"), n)

    def report(self) -> dict:
        counters = self.l3.store.counters if self.l3 else StoreCounters()
        return {**self.stats, "transfers": dict(self.transfers), "steps": self.step,
                "digest": self.cache.digest, "storage_errors": self.l3.errors if self.l3 else 0,
                "corrupt_objects": counters.corrupt_objects, "missing_objects": counters.missing_objects,
                "l3_bytes_written": counters.bytes_written, "l3_bytes_read": counters.bytes_read,
                "dropped_pages": self.cache.dropped_pages, "most_pending_sends": self.most_pending_sends,
                "prefetches_terminated": self.prefetches_terminated,
                "pp_sync": self.agreement.counts(),
                "step_us": self.step_us}

    async def close(self) -> None:
        """Awaitable: joining the storage and copy workers and flushing the pipeline sends
        happen off the event loop, so the loop's other tasks (telemetry, peers) keep running."""
        if self.tracer is not None:
            self.tracer.end()
        if self.l3 is not None:
            await anyio.to_thread.run_sync(self.l3.close)
        await anyio.to_thread.run_sync(self.cache.close)
        await self.agreement.close()
