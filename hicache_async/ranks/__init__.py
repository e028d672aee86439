"""Simulated ranks: one OS process per rank, their parallel groups, and awaitable waits."""
from .dist_wait import all_reduce, recv, wait_work
from .groups import ParallelGroups
from .launcher import RankContext, launch

__all__ = ["ParallelGroups", "RankContext", "all_reduce", "launch", "recv", "wait_work"]
