"""The scheduler side, deterministic on every rank: the plugin, the step ledger it retires
through, request admission, the tiered cache (radix tree and page residency), the storage
tier, the prefetch decision and op tracing."""
from .ledger import Ledger, StepMessage
from .plugin import HiCachePlugin

__all__ = ["HiCachePlugin", "Ledger", "StepMessage"]
