"""The replay's virtual clock, the cost model that advances it, and the forward timer.

Arrivals follow the trace's timestamps on this clock, not on wall time, so a replay on
two slow cores sees the concurrency (and so the eviction and locking) the trace would see
on a serving engine, and every rank sees the same arrivals in the same steps: the clock is
a pure function of the batches and of the modelled transfers (see `hardware`), which every
rank sees alike.

Cost model: one forward pass costs `decode_us_per_step` (a decode step of the whole batch)
plus `prefill_us_per_token` for each prompt token it computes. Cached tokens cost nothing,
so cache hits shorten the queue as they would on a real engine.
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import UsageError

if TYPE_CHECKING:
    from .trace import TraceRequest


@dataclass(frozen=True)
class CostModel:
    prefill_us_per_token: float = 20.0     # ~50k prompt tokens/s: an 8B model on one GPU
    decode_us_per_step: float = 10_000.0   # one batched decode step

    def __post_init__(self) -> None:
        for name in ("prefill_us_per_token", "decode_us_per_step"):
            if not getattr(self, name) >= 0:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")

    def forward_us(self, prefill_tokens: int) -> float:
        return self.decode_us_per_step + self.prefill_us_per_token * prefill_tokens


class VirtualClock:
    """Microseconds since the trace's first timestamp; only ever moves forward."""

    def __init__(self) -> None:
        self.now_us = 0.0

    def advance(self, us: float) -> None:
        self.now_us += us

    def jump_to(self, us: float) -> None:
        self.now_us = max(self.now_us, us)


class ForwardTimer:
    """Advances the virtual clock by each batch's cost; notes each request's TTFT (from its
    arrival, the trace's timestamp, to the end of the forward pass that computes its last
    prompt token) and how many of its prompt tokens were cached (the rest were computed)."""

    def __init__(self, clock: VirtualClock, costs: CostModel, trace: Iterable[TraceRequest],
                 loads: Callable[[], float] | None = None, layers: int = 1) -> None:
        self.clock, self.costs, self.loads, self.layers = clock, costs, loads, layers
        self.arrival_us = {r.line: r.timestamp_ms * 1e3 for r in trace}
        self.ttft_us = array("d")
        self.cached: dict[int, int] = {}     # request id -> prompt tokens it did not compute
        self.last_us = 0.0                   # end of the latest forward pass

    def forward(self, batch: list) -> None:
        """Price a batch of `ReplayChunk`s: a decode step plus each prompt token computed. A pass
        that reads KV being loaded (`loads()`: when it lands) overlaps the load layer by layer,
        so it ends no sooner than one layer's compute after the load."""
        prefill = [c for c in batch if c.start < len(c.req.prompt)]
        cost = self.costs.forward_us(sum(len(c.tokens) for c in prefill))
        landed = self.loads() if self.loads is not None else 0.0
        self.clock.advance(cost)
        self.clock.jump_to(landed + cost / self.layers)
        self.last_us = now = self.clock.now_us
        for c in prefill:
            if c.end == len(c.req.prompt):
                self.ttft_us.append(now - self.arrival_us[c.req.id])
                self.cached[c.req.id] = c.start
