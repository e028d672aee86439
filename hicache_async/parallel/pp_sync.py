"""Cross-rank agreement: MIN over the first stage's TP x CP ranks, then down the pipeline.

Stage 0 reduces the packed message over its TP x CP group; each later stage awaits it from
the stage before, folds in its own digest, and forwards it with a non-blocking send. It runs
every step on every rank, even with nothing pending: a rank that skipped it would leave its
peers waiting. Fields the caller names `world` are first MIN-reduced over the whole world
(with pp > 1), since a later stage would otherwise adopt stage 0's figure for them; the
caller names none when nothing calls for it, and that fast path costs no extra collective.

Sends are reaped by `reap()`, once per step, in one of two ways:
- NCCL (and any backend whose send Works report completion): every send whose
  `is_completed()` is true is dropped, in whatever step it finished.
- gloo: a point-to-point Work never reports completion, and its `wait()` must be called
  exactly once, so sends are reaped by age: once the oldest is REAP_AGE_STEPS steps old,
  every send at least half that old is waited for in one wait off the event loop. By then
  they have normally long finished; when a downstream stage lags, that wait is the
  backpressure that keeps the in-flight list bounded.
Either way no send outlives REAP_AGE_STEPS steps, so at most that many are ever in flight.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DivergenceError
from .agreement import Agreement
from .dist_wait import all_reduce, recv, wait_work
from .topology import RankCoords

SYNC_TAG = 11
REAP_AGE_STEPS = 8


@dataclass(eq=False)   # compared by identity: a tensor has no truth value
class _Send:
    work: dist.Work
    tensor: torch.Tensor     # referenced until reaped: the send reads it
    step: int                # the agreement (counted from 0) that issued it


class InFlightSends:
    """The sends one stage issued to the next, kept until they are known to be done."""

    def __init__(self, reports_completion: bool, coords: RankCoords, timeout_s: float) -> None:
        self.reports_completion, self.coords, self.timeout_s = reports_completion, coords, timeout_s
        self._sends: deque[_Send] = deque()
        self.issued = self.reaped = 0

    def __len__(self) -> int:
        return len(self._sends)

    def add(self, work: dist.Work, tensor: torch.Tensor, step: int) -> None:
        self._sends.append(_Send(work, tensor, step))
        self.issued += 1

    async def reap(self, step: int) -> None:
        """Drop the sends known done; wait for those REAP_AGE_STEPS old (see the module doc)."""
        if self.reports_completion:
            for send in [s for s in self._sends if s.work.is_completed()]:
                send.work.wait()     # done: returns at once, or raises the send's error
                self._sends.remove(send)
                self.reaped += 1
        if self._sends and step - self._sends[0].step >= REAP_AGE_STEPS:
            await self._wait(lambda s: step - s.step >= REAP_AGE_STEPS // 2, f"before step {step}")

    async def flush(self) -> None:
        """Wait for every send still out: a downstream stage may still be receiving them."""
        await self._wait(lambda s: True, "at close")

    async def _wait(self, due, when: str) -> None:
        sends = []
        while self._sends and due(self._sends[0]):
            sends.append(self._sends.popleft())
        if sends:
            await wait_work(_Works([s.work for s in sends]), coords=self.coords, timeout_s=self.timeout_s,
                            spin_s=0.0, what=f"{len(sends)} pp_sync sends {when}")
            self.reaped += len(sends)


class PipelineAgreement(Agreement):
    def __init__(self, coords: RankCoords, groups, timeout_s: float) -> None:
        self.coords, self.groups, self.timeout_s = coords, groups, timeout_s
        self.ranks = coords.world_size
        self.sends = InFlightSends(dist.get_backend(groups.world) != "gloo", coords, timeout_s)
        self.agreements = 0          # steps agreed so far: the clock that send ages are told by
        self.received = 0            # messages received from the previous stage
        self.world_reductions = 0    # extra collectives for pending storage ops (pp > 1)

    @property
    def pending_sends(self) -> int:
        return len(self.sends)

    def counts(self) -> dict[str, int]:
        return {"sent": self.sends.issued, "reaped": self.sends.reaped, "received": self.received,
                "world_reductions": self.world_reductions}

    async def reap(self) -> None:
        await self.sends.reap(self.agreements)

    async def agree(self, values: list[int], digest: int, step: int, world: slice | None = None) -> list[int]:
        g, c, t = self.groups, self.coords, self.timeout_s
        values = list(values)
        if world is not None and c.pp_size > 1:
            fields = torch.tensor(values[world], dtype=torch.int64)
            await all_reduce(fields, op=dist.ReduceOp.MIN, group=g.world, coords=c, timeout_s=t,
                             what=f"world agreement at step {step}")
            values[world] = fields.tolist()
            self.world_reductions += 1
        tensor = torch.tensor([*values, digest, -digest], dtype=torch.int64)
        if g.is_first_stage:
            await all_reduce(tensor, op=dist.ReduceOp.MIN, group=g.agree, coords=c, timeout_s=t,
                             what=f"pp_sync all_reduce at step {step}")
            low, high = int(tensor[-2]), -int(tensor[-1])
            if low != high:
                await self._name_divergent(digest, step)
        else:
            await recv(tensor, src=g.prev_stage, tag=SYNC_TAG, coords=c, timeout_s=t,
                       what=f"pp_sync recv from rank {g.prev_stage} at step {step}")
            self.received += 1
            upstream = int(tensor[-2])
            if digest != upstream or -int(tensor[-1]) != upstream:
                raise DivergenceError(
                    f"cache divergence at step {step}: {c.label()} digest {digest:#x} != {upstream:#x} "
                    f"agreed upstream by stage {c.pp_rank - 1} (rank {g.prev_stage})")
        if g.next_stage is not None:
            self.sends.add(dist.isend(tensor, dst=g.next_stage, tag=SYNC_TAG), tensor, self.agreements)
        self.agreements += 1
        return tensor[:-2].tolist()

    async def _name_divergent(self, own: int, step: int) -> None:
        """Every first-stage rank saw the mismatch; gather the digests to name who differs."""
        g = self.groups
        ranks = dist.get_process_group_ranks(g.agree)
        digests = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        work = dist.all_gather(digests, torch.tensor([own]), group=g.agree, async_op=True)
        await wait_work(work, coords=self.coords, timeout_s=self.timeout_s,
                        what=f"gathering digests after the divergence at step {step}")
        values = [int(d) for d in digests]
        majority = max(set(values), key=values.count)
        if values.count(majority) * 2 > len(values):
            odd = [f"rank {r}" for r, v in zip(ranks, values) if v != majority]
            raise DivergenceError(f"cache divergence at step {step}: {', '.join(odd)} made different "
                                  f"cache decisions than the other first-stage ranks")
        seen = ", ".join(f"rank {r} {v:#x}" for r, v in zip(ranks, values))
        raise DivergenceError(f"cache divergence at step {step}: first-stage ranks disagree ({seen})")

    async def close(self) -> None:
        """Flush the sends still out, off the event loop and bounded by the timeout: a downstream
        stage is waiting for them, and dropping a gloo send handle unwaited can cancel the send."""
        await self.sends.flush()


class _Works:
    """Several Works waited on as one, so reaping them costs one thread hop."""

    def __init__(self, works: list) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True
