"""The replay engine: Mooncake-format traces as a workload on a virtual clock, and a model whose
KV is a pure function of what the trace names, so every reused page can be verified."""
from .clock import CostModel, VirtualClock
from .model import ReplayModel, ReplayModelSpec, ReplayScheduler
from .trace import TraceRequest, read_trace
from .workload import ReplaySpec, ReplayWorkload

__all__ = ["CostModel", "ReplayModel", "ReplayModelSpec", "ReplayScheduler", "ReplaySpec", "ReplayWorkload",
           "TraceRequest", "VirtualClock", "read_trace"]
