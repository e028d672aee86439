"""A trace as the scheduler's workload: requests arrive at their timestamps on the virtual clock.

Request ids are the trace's line numbers, so any message naming a request names its line.
Each request carries a `ReplaySeq` (its tag): what the replay engine needs to write and name
its KV without asking any other rank.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from ...errors import UsageError
from ...request import Request
from .clock import CostModel, VirtualClock
from .hardware import HardwareModel
from .trace import TraceRequest, block_prefixes, output_page_id, prompt_page_ids, prompt_tokens


@dataclass(frozen=True)
class ReplaySpec:
    trace: str
    limit: int | None = None         # first N requests of the trace
    seed: int = 0                    # selects the tokens each block id stands for
    max_output: int | None = None    # cap on output_length (None: honour it)
    hardware: HardwareModel = HardwareModel()

    def __post_init__(self) -> None:
        if self.max_output is not None and self.max_output < 1:
            raise UsageError(f"--max-output must be >= 1, got {self.max_output}")

    @classmethod
    def from_dict(cls, d: dict) -> "ReplaySpec":
        return cls(**{**d, "hardware": HardwareModel(**d["hardware"])})

    @property
    def costs(self) -> CostModel:
        return self.hardware.costs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def max_new(self, req: TraceRequest) -> int:
        """Tokens to generate: output_length, capped, and at least the one a prefill yields."""
        cap = req.output_length if self.max_output is None else min(req.output_length, self.max_output)
        return max(1, cap)


class ReplaySeq:
    """One request's replay state: its prompt, the trace's name for each of its pages (the
    replay KV's seed, see `replay_kv`) and the seed of its generated tokens."""

    def __init__(self, req: TraceRequest, prompt: np.ndarray, page_size: int, seed: int = 0) -> None:
        self.line = req.line
        self.prompt = prompt
        self._prefixes = block_prefixes(req, seed)
        self.prompt_ids = prompt_page_ids(req, page_size, seed, self._prefixes)
        self.out_seed = int.from_bytes(hashlib.sha256(prompt.tobytes()).digest()[:8], "little")

    def page_id(self, page: int) -> int:
        """The name of page `page`: a prompt page's from the trace, a page holding outputs
        from the prompt it follows and its place."""
        if page < len(self.prompt_ids):
            return int(self.prompt_ids[page])
        return output_page_id(self._prefixes, len(self.prompt), page)


class ReplayWorkload:
    """Hands out the trace's requests as the virtual clock passes their timestamps."""

    def __init__(self, trace: list[TraceRequest], spec: ReplaySpec, page_size: int,
                 clock: VirtualClock) -> None:
        self.trace, self.spec, self.page_size, self.clock = trace, spec, page_size, clock
        self._next = 0
        self.completed = 0

    def arrivals(self) -> list[Request]:
        if self._next == self.completed and self._next < len(self.trace):   # none in flight
            self.clock.jump_to(self.trace[self._next].timestamp_ms * 1e3)   # idle: skip ahead
        out = []
        while self._next < len(self.trace) and self.trace[self._next].timestamp_ms * 1e3 <= self.clock.now_us:
            out.append(self.request(self.trace[self._next]))
            self._next += 1
        return out

    def request(self, req: TraceRequest) -> Request:
        """The engine's request for a trace line, tagged with what the replay engine needs."""
        prompt = prompt_tokens(req, self.spec.seed)
        return Request(req.line, prompt.tolist(), self.spec.max_new(req),
                       tag=ReplaySeq(req, prompt, self.page_size, self.spec.seed), cache_salt=req.cache_salt)

    @property
    def next_arrival_us(self) -> float:
        """When the next request arrives on the virtual clock (inf: none left)."""
        return self.trace[self._next].timestamp_ms * 1e3 if self._next < len(self.trace) else math.inf

    def complete(self, req: Request) -> None:
        self.completed += 1

    @property
    def done(self) -> bool:
        return self.completed == len(self.trace)
