"""Ranks working as one: topology and groups, bounded waits on collectives, and the per-step
MIN agreement (with its divergence check) that makes every rank retire the same ops."""
from ..topology import RankCoords
from .agreement import NOT_READY, Agreement, LocalAgreement
from .groups import ParallelGroups
from .pp_sync import PipelineAgreement

__all__ = ["NOT_READY", "Agreement", "LocalAgreement", "ParallelGroups", "PipelineAgreement", "RankCoords"]
