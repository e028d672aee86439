"""The replay engine: a model that leaves real, checkable KV in the device pages, at trace scale.

A transformer at 10^4-token prompts and thousands of requests is too slow for two cores, and
its KV cannot be predicted. This model does no math: its forward pass writes the KV a model
would leave (`ReplayKV`, a pure function of each page's prefix and coordinates) and
returns tokens that are a pure function of the prompt. So the cache moves real bytes through
every tier, every reused page can be verified, and ranks agree without any collective: the
plugin's per-step agreement alone keeps them in lockstep. TP splits the kv heads (above
their number it replicates each, as GQA engines do), PP the layers; every CP rank holds the
full KV of its layers and heads.

A page's KV is written in the forward pass that fills it (prefill, or the decode step that
completes it). Only full pages are ever cached, so nothing reads a page before it is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import anyio
import numpy as np
import torch

from ...errors import UsageError
from ...layout import KVLayout
from ...request import Request
from ...topology import RankCoords, check_topology, kv_head_range, split_range
from ..scheduler import Scheduler
from ..tiny.model import SeqChunk
from .clock import ForwardTimer
from .kv import ReplayKV
from .splitmix import splitmix64
from .trace import VOCAB
from .workload import ReplayWorkload


@dataclass(frozen=True)
class ReplayModelSpec:
    """Small by default (8 KiB a page at page size 64), so a whole trace fits every tier;
    4 layers and 2 kv heads so --pp 2/4 and --tp 2 split it."""

    layers: int = 4
    kv_heads: int = 2
    head_dim: int = 4
    model_id: str = "replay-kv-v2"    # v2: KV named by the trace, not the page hash


@dataclass
class ReplayChunk(SeqChunk):
    req: Request | None = None    # whose tokens these are: the model names its pages by it


class ReplayScheduler(Scheduler):
    """The reference scheduler, handing the replay model each chunk's request. On a modelled
    clock an idle loop jumps to the next arrival or modelled completion, whichever is first."""

    async def idle(self, workload: ReplayWorkload) -> None:
        clock = self.context.clock
        ahead = min(workload.next_arrival_us, clock.next_event_us()) if clock.modelled else math.inf
        if ahead == math.inf:      # nothing modelled ahead: what is due waits for its bytes
            return await super().idle(workload)
        clock.virtual.jump_to(ahead)
        await anyio.lowlevel.checkpoint()

    @staticmethod
    def chunk(req: Request) -> ReplayChunk:
        c = Scheduler.chunk(req)
        return ReplayChunk(c.tokens, c.start, c.pages, req)


class ReplayModel:
    def __init__(self, spec: ReplayModelSpec, page_size: int, timer: ForwardTimer,
                 coords: RankCoords | None = None, groups=None) -> None:
        self.spec, self.page_size, self.timer = spec, page_size, timer
        self.coords = coords = coords or RankCoords()
        self.groups = groups
        check_topology(coords.tp_size, coords.pp_size, coords.cp_size, num_layers=spec.layers,
                       kv_heads=spec.kv_heads, attention="mha")
        self.layers = split_range(spec.layers, coords.pp_size, coords.pp_rank)
        self.heads = kv_head_range(spec.kv_heads, coords.tp_size, coords.tp_rank)
        self.kv = ReplayKV(spec.layers, spec.kv_heads, spec.head_dim, page_size, self.layers, self.heads)

    def kv_layout(self, page_size: int) -> KVLayout:
        if page_size != self.page_size:
            raise UsageError(f"replay model built for page size {self.page_size}, asked for {page_size}")
        return KVLayout(num_layers=len(self.layers), kv_heads=len(self.heads), head_dim=self.spec.head_dim,
                        page_size=page_size, dtype=torch.float16, attention="mha",
                        first_layer=self.layers.start, first_head=self.heads.start,
                        total_layers=self.spec.layers, total_kv_heads=self.spec.kv_heads,
                        model_id=self.spec.model_id)

    async def forward(self, batch: list[ReplayChunk], kv: torch.Tensor, layer_ready=None) -> list[int]:
        """Write the KV of every page this batch fills, layer by layer after `layer_ready`,
        advance the virtual clock by the batch's cost, return each sequence's next token."""
        ps = self.page_size
        ids, pages = [], []
        for chunk in batch:
            seq = chunk.req.tag
            for page in range(chunk.start // ps, chunk.end // ps):
                ids.append(seq.page_id(page))
                pages.append(chunk.pages[page])
        values = self.kv.pages(ids) if ids else None
        index = torch.from_numpy(np.array(pages, dtype=np.int64))
        for layer in range(len(self.layers)):
            if layer_ready is not None:
                await layer_ready(layer)
            if values is not None:
                kv[layer].index_copy_(0, index, values[layer])
        self.timer.forward(batch)
        return next_tokens([c.req for c in batch])


def next_tokens(reqs: list[Request]) -> list[int]:
    """Each request's next token: mixed from its prompt's seed and how many it generated."""
    seeds = np.array([r.tag.out_seed for r in reqs], dtype=np.uint64)
    count = np.array([len(r.output) for r in reqs], dtype=np.uint64)
    return (splitmix64(seeds ^ count) % np.uint64(VOCAB)).tolist()
