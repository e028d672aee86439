"""Simulated ranks: one OS process per rank, their parallel groups, and awaitable waits."""
from .dist_wait import SendHandle, all_reduce, isend, recv, wait_work
from .groups import ParallelGroups
from .launcher import RankContext, launch

__all__ = ["ParallelGroups", "RankContext", "SendHandle", "all_reduce", "isend", "launch", "recv",
           "wait_work"]
