"""The engines the cache is proven on: the scheduler loop they share, the cache-less plugin,
the KV witness; `tiny` (a real transformer, for `simulate`) and `replay` (trace-driven KV that
is a pure function, for `replay`)."""
from .kv_witness import KVCheck
from .plain import PlainKV
from .scheduler import Scheduler
from .tiny import ModelConfig, SeqChunk, TinyModel, Workload, WorkloadSpec

__all__ = ["KVCheck", "ModelConfig", "PlainKV", "Scheduler", "SeqChunk", "TinyModel", "Workload", "WorkloadSpec"]
