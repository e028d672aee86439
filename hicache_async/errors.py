"""Error types the CLI maps to exit codes: usage -> 2, everything else -> 1."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio


class HiCacheError(Exception):
    """A runtime failure with a one-line message meant for the user."""


class UsageError(HiCacheError):
    """Bad flags or configuration; the message names the bad value."""


class EngineMissing(UsageError):
    """An engine's integration was asked for where the engine is not installed; the message
    names the extra that installs it (the integration knows it, the core names no engine)."""


class PoolExhausted(HiCacheError):
    """A pool cannot hand out the pages asked for, even after eviction."""


class SyncTimeout(HiCacheError):
    """A cross-rank operation did not finish in time; names rank and operation."""


class DivergenceError(HiCacheError):
    """Ranks made different cache decisions in the same step."""


class StorageError(HiCacheError):
    """An L3 backend failed (unreachable, out of space, I/O error)."""


class CopyFailed(HiCacheError):
    """A copy between the pools or a device's blocks failed: its events complete with this
    error instead of hanging."""


@contextmanager
def bounded(timeout_s: float, what: str) -> Iterator[None]:
    """anyio's deadline around a wait, turned into the one-line SyncTimeout naming `what`."""
    try:
        with anyio.fail_after(timeout_s):
            yield
    except TimeoutError:
        raise SyncTimeout(f"{what}: not complete after {timeout_s:g} s") from None
