"""The tiny reference transformer (MHA/GQA or MLA, split over TP/PP/CP), its seeded multi-turn
workload and the KV a cache-less run records, which `simulate` checks every cached page against."""
from .config import ModelConfig
from .model import SeqChunk, TinyModel
from .workload import Workload, WorkloadSpec

__all__ = ["ModelConfig", "SeqChunk", "TinyModel", "Workload", "WorkloadSpec"]
