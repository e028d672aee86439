"""Requests in and out of the tiered cache: admission (prefix reuse, L3 prefetch, loads),
the per-layer wait for loads, finishing, and what the plugin keeps per request meanwhile.

The engine's `Request` carries only what the engine needs (pages, cached tokens); the
plugin's own per-request state lives here, keyed by request id, from the first admission
attempt to `finish`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import CacheConfig
from ..errors import CopyFailed, PoolExhausted
from ..keys import page_hashes
from ..request import Request
from .cache import TieredCache
from .node import Node
from .op_tracing import OpTracer
from .ops import CacheOp, StorageOp
from .page_history import L3Look, Miss
from .prefetch_cost import Decision, PrefetchCost
from .radix import Match
from .storage_tier import StorageTier


@dataclass(eq=False)
class RequestState:
    l3_considered: bool = False         # the prefetch decision is made once per request
    decision: Decision | None = None    # that decision, for the request's span
    prefetch: StorageOp | None = None   # the L3 prefetch its admission waits for
    lock: Node | None = None            # the cached prefix its admission locked on the device
    load: CacheOp | None = None         # the L2 -> L1 load its first forward waits for
    origin: list[str] = field(default_factory=list)   # the tier each cached page came from
    hashes: list[str] | None = None     # of the prompt's full pages before its last token, once needed
    look: L3Look | None = None          # what its look at L3 found, to explain a miss
    committed: int = 0                  # pages its prefetch fetched


class Admissions:
    def __init__(self, config: CacheConfig, cache: TieredCache, l3: StorageTier | None,
                 prefetch_cost: PrefetchCost, tracer: OpTracer) -> None:
        self.config, self.cache, self.l3 = config, cache, l3
        self.prefetch_cost, self.tracer = prefetch_cost, tracer
        self.requests: dict[int, RequestState] = {}
        self.stats = {"prompt_tokens": 0, "tokens_from_l1": 0, "tokens_from_l2": 0,
                      "tokens_from_l3": 0, "tokens_computed": 0}
        self.misses: dict[str, str] = {}    # request id -> why the page after its cached prefix missed (planner)

    def admit(self, req: Request) -> bool:
        state = self.requests.setdefault(req.id, RequestState())
        if state.prefetch is not None:
            state.prefetch.wanted = True
            return False
        ps = self.config.page_size
        need = req.pages_needed(ps)
        if need > self.config.device_pages:
            raise PoolExhausted(f"request {req.id} needs {need} device pages but --device-pages is "
                                f"{self.config.device_pages}")
        tokens = req.prompt[:-1]       # the last prompt token is always computed, for its logits
        match = self.cache.match(tokens, req.cache_salt)
        if self.l3 is not None and not state.l3_considered:
            state.l3_considered = True
            if self._start_prefetch(req, state, tokens, match):
                return False
        admitted = self.cache.admit(match, need, req.id)
        if admitted is None:
            return False
        state.lock, state.load, state.origin = admitted.lock, admitted.load, admitted.origin
        host_tokens = match.host_tokens
        l3_tokens = admitted.origin.count("l3") * ps
        req.pages = admitted.pages
        req.cached = req.kv_len = match.device_tokens + host_tokens
        self.tracer.admission(req, match.device_tokens, host_tokens, state.decision)
        self._count("tokens_from_l1", match.device_tokens)
        self._count("tokens_from_l3", l3_tokens)
        self._count("tokens_from_l2", host_tokens - l3_tokens)
        self._count("tokens_computed", len(req.prompt) - req.cached)
        self.stats["prompt_tokens"] += len(req.prompt)
        if self.cache.history is not None and req.cached < len(tokens) // ps * ps:
            self.misses[str(req.id)] = self._why_missed(req, state, tokens, req.cached // ps).value
        return True

    def _hashes(self, req: Request, state: RequestState, tokens: list[int]) -> list[str]:
        if state.hashes is None:
            ps = self.config.page_size
            state.hashes = page_hashes(tokens[: len(tokens) // ps * ps], ps, salt=req.cache_salt)
        return state.hashes

    def _why_missed(self, req: Request, state: RequestState, tokens: list[int], page: int) -> Miss:
        """Why full page `page` of the prompt, the first one not served, was not."""
        looked = state.look.why_missed(page, state.committed) if state.look is not None else None
        return looked or self.cache.history.why_absent(self._hashes(req, state, tokens)[page], self.l3 is not None)

    def _start_prefetch(self, req: Request, state: RequestState, tokens: list[int], match: Match) -> bool:
        """Fetch the prompt's full pages that L1 and L2 miss from L3, if that beats recomputing
        them; True if the admission now waits for it."""
        ps = self.config.page_size
        full = len(tokens) // ps
        cached_pages = (match.device_tokens + match.host_tokens) // ps
        if full <= cached_pages:
            return False
        hashes = self._hashes(req, state, tokens)
        end, beyond = full, None
        if self.cache.ledger.clock.modelled:    # only what L3 holds in modelled time, as every rank knows
            end = cached_pages + self.cache.history.stored_run(hashes, cached_pages, self.l3.store.stored_run)
            beyond = self.cache.history.why_absent(hashes[end], l3=True) if end < full else None
        missing = end - cached_pages
        state.look = L3Look(cached_pages, end, beyond, None)
        if missing <= 0:
            return False
        state.decision = self.prefetch_cost.decide(missing, missing * ps)
        if not state.decision.fetch:
            state.look = L3Look(cached_pages, end, beyond, Miss.DECLINED)
            return False
        op = self.l3.prefetch(req.id, match.last_node, tokens[: end * ps], cached_pages, hashes[:end],
                              salt=req.cache_salt)
        if op is None:
            state.look = L3Look(cached_pages, end, beyond, Miss.NO_HOST_ROOM)
            return False
        if op.span is not None and op.span.is_recording():
            op.span.set_attributes(state.decision.attributes())
        state.prefetch = op
        return True

    def fetching(self, req: Request) -> bool:
        """Whether `req` waits for an L3 prefetch: admitting it only marks it wanted."""
        state = self.requests.get(req.id)
        return state is not None and state.prefetch is not None

    def prefetched(self, op: StorageOp) -> None:
        """`op` retired: its request may be admitted now, from what it committed."""
        state = self.requests[op.request_id]
        state.prefetch, state.committed = None, op.committed

    def kv_origin(self, req: Request) -> list[str]:
        state = self.requests.get(req.id)
        return state.origin if state is not None else []

    async def layer_ready(self, reqs: list[Request], layer: int) -> None:
        for req in reqs:
            state = self.requests.get(req.id)
            op = state.load if state is not None else None
            if op is None:
                continue
            event = op.events[layer]
            if not event.query():
                await event.wait(self.config.sync_timeout_s, f"{self.tracer.coords.label()}: load of layer {layer}")
            if event.error is not None:
                raise CopyFailed(f"{self.tracer.coords.label()}: load op of {op.pages} pages for request {req.id} "
                                 f"failed: {event.error}")

    def finish(self, req: Request) -> None:
        state = self.requests.pop(req.id)
        ps = self.config.page_size
        tokens = req.kv_tokens[: req.kv_len // ps * ps]
        self.cache.finish(tokens, req.pages, page_hashes(tokens, ps, salt=req.cache_salt), state.lock,
                          req.cache_salt)
        req.pages = []

    def _count(self, stat: str, n: int) -> None:
        self.stats[stat] += n
        if n:
            self.tracer.metrics.tokens(stat.removeprefix("tokens_").removeprefix("from_"), n)
