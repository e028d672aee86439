"""Cross-rank agreement: MIN over the first stage's TP x CP ranks, then down the pipeline.

Stage 0 reduces the packed message over its TP x CP group; each later stage awaits it from
the stage before, folds in its own digest, and forwards it with a non-blocking send. It runs
every step on every rank, even with nothing pending: a rank that skipped it would leave its
peers waiting.

Send handles: gloo's point-to-point works never report completion, so sends are reaped by
waiting on them once MAX_IN_FLIGHT_SENDS are out, oldest half in one background wait (one
thread hop per several steps). By then they have normally finished; when a downstream
stage lags, that wait is the backpressure that keeps the list bounded.
"""
from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from .agreement import DIGEST, PAGES, PREFETCH, PREFETCH_SLOTS
from .errors import DivergenceError
from .ranks.dist_wait import all_reduce, recv, wait_work
from .topology import RankCoords

SYNC_TAG = 11
MAX_IN_FLIGHT_SENDS = 8
_PREFETCH = slice(PREFETCH, PAGES + PREFETCH_SLOTS)


class PipelineAgreement:
    def __init__(self, coords: RankCoords, groups, timeout_s: float) -> None:
        self.coords, self.groups, self.timeout_s = coords, groups, timeout_s
        self._sends: deque = deque()

    @property
    def pending_sends(self) -> int:
        return len(self._sends)

    def reap(self) -> None:
        """Nothing to poll: gloo sends are reaped by age in `_send` (see the module doc)."""

    async def agree(self, msg: list[int], step: int, prefetch_pending: bool = False) -> list[int]:
        g, c, t = self.groups, self.coords, self.timeout_s
        own = msg[DIGEST]
        if prefetch_pending and c.pp_size > 1:
            # Prefetched pages must be present on every stage, so their MIN spans the world.
            fields = torch.tensor(msg[_PREFETCH])
            await all_reduce(fields, op=dist.ReduceOp.MIN, group=g.world, coords=c, timeout_s=t,
                             what=f"prefetch agreement at step {step}")
            msg[_PREFETCH] = fields.tolist()
        tensor = torch.tensor(msg, dtype=torch.int64)
        if g.is_first_stage:
            await all_reduce(tensor, op=dist.ReduceOp.MIN, group=g.agree, coords=c, timeout_s=t,
                             what=f"pp_sync all_reduce at step {step}")
            agreed = tensor.tolist()
            if agreed[DIGEST] != -agreed[DIGEST + 1]:
                await self._name_divergent(own, step)
        else:
            await recv(tensor, src=g.prev_stage, tag=SYNC_TAG, coords=c, timeout_s=t,
                       what=f"pp_sync recv from rank {g.prev_stage} at step {step}")
            agreed = tensor.tolist()
            upstream = agreed[DIGEST]
            agreed[DIGEST], agreed[DIGEST + 1] = min(upstream, own), min(agreed[DIGEST + 1], -own)
            if agreed[DIGEST] != -agreed[DIGEST + 1]:
                raise DivergenceError(
                    f"cache divergence at step {step}: {c.label()} digest {own:#x} != {upstream:#x} "
                    f"agreed upstream by stage {c.pp_rank - 1} (rank {g.prev_stage})")
            tensor[DIGEST], tensor[DIGEST + 1] = agreed[DIGEST], agreed[DIGEST + 1]
        if g.next_stage is not None:
            await self._send(tensor, step)
        return agreed

    async def _send(self, tensor: torch.Tensor, step: int) -> None:
        if len(self._sends) >= MAX_IN_FLIGHT_SENDS:
            oldest = _Sends([self._sends.popleft()[0] for _ in range(MAX_IN_FLIGHT_SENDS // 2)])
            await wait_work(oldest, coords=self.coords, timeout_s=self.timeout_s, spin_s=0.0,
                            what=f"pp_sync sends to rank {self.groups.next_stage} before step {step}")
        # The tensor stays referenced beside its handle until the send is reaped.
        self._sends.append((dist.isend(tensor, dst=self.groups.next_stage, tag=SYNC_TAG), tensor))

    async def _name_divergent(self, own: int, step: int) -> None:
        """Every first-stage rank saw the mismatch; gather the digests to name who differs."""
        g = self.groups
        ranks = dist.get_process_group_ranks(g.agree)
        digests = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        dist.all_gather(digests, torch.tensor([own]), group=g.agree)
        values = [int(d) for d in digests]
        majority = max(set(values), key=values.count)
        if values.count(majority) * 2 > len(values):
            odd = [f"rank {r}" for r, v in zip(ranks, values) if v != majority]
            raise DivergenceError(f"cache divergence at step {step}: {', '.join(odd)} made different "
                                  f"cache decisions than the other first-stage ranks")
        seen = ", ".join(f"rank {r} {v:#x}" for r, v in zip(ranks, values))
        raise DivergenceError(f"cache divergence at step {step}: first-stage ranks disagree ({seen})")

    def close(self) -> None:
        """Flush the sends still out: a downstream stage is waiting for them. Dropping a gloo
        send handle unwaited can cancel the send."""
        while self._sends:
            self._sends.popleft()[0].wait()


class _Sends:
    """Several send works waited on as one, so reaping them costs one thread hop."""

    def __init__(self, works: list) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True
