"""Rank start-up: local processes joined by torch.distributed on loopback, or the processes
torchrun started; every wait bounded, a hang named by rank and operation."""
from .launcher import RankContext, launch

__all__ = ["RankContext", "launch"]
