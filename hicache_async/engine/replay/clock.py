"""The replay's virtual clock and the cost model that advances it.

Arrivals follow the trace's timestamps on this clock, not on wall time, so a replay on
two slow cores sees the concurrency (and so the eviction and locking) the trace would see
on a serving engine, and every rank sees the same arrivals in the same steps: the clock is
a pure function of the batches, which every rank builds identically. (Copies and storage
I/O still complete in wall time, so two runs may differ; two ranks never do.)

Cost model: one forward pass costs `decode_us_per_step` (a decode step of the whole batch)
plus `prefill_us_per_token` for each prompt token it computes. Cached tokens cost nothing,
so cache hits shorten the queue as they would on a real engine. When nothing is in flight
the clock jumps to the next arrival.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError


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
