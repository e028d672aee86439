"""Cross-rank agreement: MIN over the first stage's TP x CP ranks, then down the pipeline.

Stage 0 reduces the packed message over its TP x CP group; each later stage awaits it from
the stage before, folds in its own digest, and forwards it with a non-blocking send. The
send handles are reaped on the next step; a bounded list applies backpressure when a
downstream stage lags. It runs every step on every rank, even with nothing pending: a
rank that skipped it would leave its peers waiting.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from .agreement import DIGEST, PAGES, PREFETCH, PREFETCH_SLOTS, fold
from .errors import DivergenceError
from .ranks.dist_wait import all_reduce, isend, recv, wait_work
from .topology import RankCoords

SYNC_TAG = 11
MAX_IN_FLIGHT_SENDS = 4
_DIGESTS = slice(DIGEST, DIGEST + 2)
_PREFETCH = slice(PREFETCH, PAGES + PREFETCH_SLOTS)


class PipelineAgreement:
    def __init__(self, coords: RankCoords, groups, timeout_s: float) -> None:
        self.coords, self.groups, self.timeout_s = coords, groups, timeout_s
        self._sends: deque = deque()

    @property
    def pending_sends(self) -> int:
        return len(self._sends)

    def reap(self) -> None:
        """Drop the send handles that completed; the list stays short."""
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    async def agree(self, msg: torch.Tensor, step: int, prefetch_pending: bool = False) -> torch.Tensor:
        g, c, t = self.groups, self.coords, self.timeout_s
        if prefetch_pending and c.pp_size > 1:
            # Prefetched pages must be present on every stage, so their MIN spans the world.
            fields = msg[_PREFETCH].clone()
            await all_reduce(fields, op=dist.ReduceOp.MIN, group=g.world, coords=c, timeout_s=t,
                             what=f"prefetch agreement at step {step}")
            msg[_PREFETCH] = fields
        if g.is_first_stage:
            own = int(msg[DIGEST])
            if g.agree is not None:
                await all_reduce(msg, op=dist.ReduceOp.MIN, group=g.agree, coords=c, timeout_s=t,
                                 what=f"pp_sync all_reduce at step {step}")
            if int(msg[DIGEST]) != -int(msg[DIGEST + 1]):
                await self._name_divergent(own, step)
        else:
            own = msg.clone()
            await recv(msg, src=g.prev_stage, tag=SYNC_TAG, coords=c, timeout_s=t,
                       what=f"pp_sync recv from rank {g.prev_stage} at step {step}")
            upstream = int(msg[DIGEST])
            fold(msg, own, _DIGESTS)
            if int(msg[DIGEST]) != -int(msg[DIGEST + 1]):
                raise DivergenceError(
                    f"cache divergence at step {step}: {c.label()} digest {int(own[DIGEST]):#x} "
                    f"!= {upstream:#x} agreed upstream by stage {c.pp_rank - 1} (rank {g.prev_stage})")
        if g.next_stage is not None:
            while len(self._sends) >= MAX_IN_FLIGHT_SENDS:
                work, _ = self._sends.popleft()
                await wait_work(work, coords=c, timeout_s=t,
                                what=f"pp_sync send to rank {g.next_stage} at step {step}")
            sent = msg.clone()     # kept alive with its handle until the send completes
            self._sends.append((isend(sent, dst=g.next_stage, tag=SYNC_TAG), sent))
        return msg

    async def _name_divergent(self, own: int, step: int) -> None:
        """Every first-stage rank saw the mismatch; gather the digests to name who differs."""
        g = self.groups
        size = dist.get_world_size(g.agree)
        digests = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(digests, torch.tensor([own]), group=g.agree)
        values = [int(d) for d in digests]
        majority = max(set(values), key=values.count)
        ranks = dist.get_process_group_ranks(g.agree)
        odd = [f"rank {r}" for r, v in zip(ranks, values) if v != majority]
        raise DivergenceError(f"cache divergence at step {step}: {', '.join(odd)} made different cache "
                              f"decisions than the other first-stage ranks")

    def close(self) -> None:
        self._sends.clear()
