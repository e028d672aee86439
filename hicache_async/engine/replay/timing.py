"""The same trace timed with no cache and with an ideal one, for the replay's TTFT to stand beside.

A TTFT only means something beside what the same trace would get with no cache at all and
with an ideal cache (every token the unbounded oracle could reuse is free). `timed_run`
replays the trace through the same scheduler, batching and `ForwardTimer` as the replay,
with a model that moves no KV and a plugin that only hands out pages, so it costs seconds.
"""
from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass

import anyio
import torch

from ...layout import KVLayout
from ...request import Request
from ...topology import RankCoords
from ..plain import PlainKV
from .clock import ForwardTimer, VirtualClock
from .model import ReplayScheduler
from .trace import TraceRequest
from .workload import ReplaySpec, ReplayWorkload


class TimingModel:
    """The replay engine's batching and costs without its KV: for timing alone."""

    def __init__(self, page_size: int, timer: ForwardTimer) -> None:
        self.page_size, self.timer = page_size, timer
        self.coords, self.groups = RankCoords(), None

    def kv_layout(self, page_size: int) -> KVLayout:
        return KVLayout(num_layers=1, kv_heads=1, head_dim=1, page_size=page_size, dtype=torch.float16)

    async def forward(self, batch: list, kv: torch.Tensor, layer_ready=None) -> list[int]:
        self.timer.forward(batch)
        return [0] * len(batch)


class FreeTokens(PlainKV):
    """No cache, but each request's first `free[id]` prompt tokens cost nothing: the ideal cache."""

    def __init__(self, free: Mapping[int, int]) -> None:
        super().__init__()
        self.free = free

    def admit(self, req: Request) -> bool:
        if not super().admit(req):
            return False
        req.cached = req.kv_len = self.free.get(req.id, 0)
        return True


class TimingWorkload(ReplayWorkload):
    """The trace's arrivals as bare requests: a prompt's length is all the timing needs."""

    def request(self, req: TraceRequest) -> Request:
        return Request(req.line, range(req.input_length), self.spec.max_new(req))


@dataclass(frozen=True)
class Timing:
    ttft_us: array          # one per request
    last_us: float          # end of the last forward pass


def timed_run(trace: list[TraceRequest], spec: ReplaySpec, page_size: int, device_pages: int,
              free: Mapping[int, int] | None = None) -> Timing:
    """The trace on one rank with no cache (`free` None) or with `free[id]` prompt tokens of
    each request cached for nothing; the device pool bounds the batch as in the replay."""
    clock = VirtualClock()
    timer = ForwardTimer(clock, spec.costs, trace)
    plugin = FreeTokens(free) if free is not None else PlainKV()
    scheduler = ReplayScheduler(TimingModel(page_size, timer), plugin, device_pages=device_pages,
                                page_size=page_size)
    anyio.run(scheduler.run, TimingWorkload(trace, spec, page_size, clock))
    return Timing(timer.ttft_us, timer.last_us)
