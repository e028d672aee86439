"""Error types the CLI maps to exit codes: usage -> 2, everything else -> 1."""


class HiCacheError(Exception):
    """A runtime failure with a one-line message meant for the user."""


class UsageError(HiCacheError):
    """Bad flags or configuration; the message names the bad value."""


class PoolExhausted(HiCacheError):
    """A pool cannot hand out the pages asked for, even after eviction."""


class SyncTimeout(HiCacheError):
    """A cross-rank operation did not finish in time; names rank and operation."""


class DivergenceError(HiCacheError):
    """Ranks made different cache decisions in the same step."""


class StorageError(HiCacheError):
    """An L3 backend failed (unreachable, out of space, I/O error)."""
