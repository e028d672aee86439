"""The torch.distributed groups one rank talks over, created in the same order on every rank."""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch.distributed as dist

from ..topology import RankCoords


@dataclass(frozen=True)
class ParallelGroups:
    """Groups of one rank; a group of one rank is None, so callers skip the collective.

    `agree` is the tp x cp group of pipeline stage 0, where ranks agree on how many ops to retire;
    it is None on later stages, which receive the agreed value from `prev_stage` instead.
    """

    world: dist.ProcessGroup
    tp: dist.ProcessGroup | None
    cp: dist.ProcessGroup | None
    stage: dist.ProcessGroup | None
    agree: dist.ProcessGroup | None
    prev_stage: int | None
    next_stage: int | None
    last_stage_root: int

    @property
    def is_first_stage(self) -> bool:
        return self.prev_stage is None

    @property
    def is_last_stage(self) -> bool:
        return self.next_stage is None

    @classmethod
    def build(cls, coords: RankCoords) -> "ParallelGroups":
        """Call on every rank after init_process_group: new_group is itself a collective."""
        grid = [RankCoords.of(r, coords.tp_size, coords.pp_size, coords.cp_size)
                for r in range(coords.world_size)]
        tp = _member_group(coords, grid, lambda c: (c.pp_rank, c.cp_rank))
        cp = _member_group(coords, grid, lambda c: (c.pp_rank, c.tp_rank))
        stage = _member_group(coords, grid, lambda c: c.pp_rank)
        agree = _new_group([c.rank for c in grid if c.pp_rank == 0])  # every rank must call it
        last = coords.pp_size - 1
        return cls(
            world=dist.group.WORLD,
            tp=tp, cp=cp, stage=stage,
            agree=agree if coords.pp_rank == 0 else None,
            prev_stage=coords.peer(pp_rank=coords.pp_rank - 1) if coords.pp_rank > 0 else None,
            next_stage=coords.peer(pp_rank=coords.pp_rank + 1) if coords.pp_rank < last else None,
            last_stage_root=coords.peer(tp_rank=0, cp_rank=0, pp_rank=last),
        )


def _member_group(coords: RankCoords, grid: list[RankCoords],
                  key: Callable[[RankCoords], Hashable]) -> dist.ProcessGroup | None:
    """Create the group for every value of `key` (in grid order) and return this rank's."""
    parts: dict[Hashable, list[int]] = {}
    for c in grid:
        parts.setdefault(key(c), []).append(c.rank)
    mine = None
    for k, ranks in parts.items():
        group = _new_group(ranks)
        if k == key(coords):
            mine = group
    return mine


def _new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    return dist.new_group(ranks) if len(ranks) > 1 else None
