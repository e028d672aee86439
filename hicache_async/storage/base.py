"""The L3 adapter protocol, and how a backend name becomes an adapter.

Adapters move opaque byte objects by key; they know nothing of KV layout. Each method is
one batch call, so a network backend pays one round trip per batch, not per page.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from importlib.metadata import entry_points
from typing import ClassVar

from ..errors import StorageError, UsageError

ENTRY_POINT_GROUP = "hicache_async.storage"
DEFAULT_STORAGE = "file"  # embedded: needs no server, and L3 outlives the run
MISSING = -1     # batch_get: the object is absent (or the read failed)
WRONG_SIZE = -2  # batch_get: the object is present but larger than the buffer
FORGED = -3      # batch_get: the object is present but fails authentication (a sealed store)

_call = threading.local()


def call_abandoned() -> bool:
    """Whether the caller of the adapter call running on this thread stopped waiting for it.

    A caller that gave up (see `guarded.py`) may already have handed the call's buffers to
    other data, so an adapter checks this before it writes into a caller's buffer again.
    """
    flag = getattr(_call, "abandoned", None)
    return flag is not None and flag.is_set()


def buffer_address(view: memoryview) -> int | None:
    """Where a writable buffer's bytes start, for zero-copy calls and GIL-free copies
    (`ctypes.memmove`); None for read-only memory, which a caller must copy instead."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def run_abandonable(abandoned: threading.Event, call: Callable[[], object]) -> object:
    """Run `call` on this thread with `abandoned` as what `call_abandoned` reports."""
    _call.abandoned = abandoned
    try:
        return call()
    finally:
        _call.abandoned = None


class AbandonedCall(StorageError):
    """The caller stopped waiting for a storage call that is still running.

    Until it returns, the call may still write into the buffers it was given, whatever the
    adapter's own checks of `call_abandoned`: a zero-copy backend's transfer already under
    way cannot be recalled. So whoever owns those buffers keeps them from other data until
    `when_returned` calls back.
    """

    def __init__(self, message: str, running: Future) -> None:
        super().__init__(message)
        self._running = running

    def returned(self) -> bool:
        """Whether the call has returned: it writes nothing more."""
        return self._running.done()

    def when_returned(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the call's thread, or here if it already returned) once the call has."""
        self._running.add_done_callback(lambda _: callback())


class StorageAdapter(ABC):
    """An L3 backend. An outage raises `StorageError` with a one-line message.

    Methods may be called from several threads at once. The class-level hooks (`add_options`,
    `open_session`, `takes_capacity`) let a backend own its setup, so the CLI and the launcher
    hold no backend's name: an installed backend brings its own flags and its own servers.
    """

    takes_capacity: ClassVar[bool] = False
    """Whether `open_session` honours `capacity_bytes` (`--l3-capacity`)."""

    lands_each: ClassVar[bool] = False
    """Whether `batch_get_parts` fills objects one at a time, in order, and calls `landed` for
    each before it writes any byte of the next: a caller may then hand it parts that reuse
    memory across objects (a ring that stays in cache), freed as `landed` returns."""

    @classmethod
    def add_options(cls, group) -> None:
        """Add this backend's own command-line flags with `group.add_argument` (argparse's).

        Name them for the backend (`--mooncake-master`); their values reach `open_session`
        by dest, and the CLI refuses one given while another backend is chosen.
        """

    @classmethod
    @contextlib.contextmanager
    def open_session(cls, options: dict, *, capacity_bytes: int | None = None,
                     cold: bool = False) -> Iterator[dict]:
        """Set up one run, once, in the process that launches its ranks; yield the keyword
        arguments every rank constructs the adapter with.

        `options` are this backend's flags by dest (None where not given). What it yields must
        be plain JSON (it crosses processes); what it starts (a server, a scratch directory) it
        stops on exit. `cold` asks for an L3 that starts empty unless the options name a shared
        one. An unreachable backend raises `StorageError` (a run with `--storage-optional` then
        goes on without L3); bad options raise `UsageError`. By default: the flags given, as is.
        """
        yield {k: v for k, v in options.items() if v is not None}

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """Length of the leading run of `keys` that are present."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        """Store each value (bytes-like) under its key; per-object success."""

    @abstractmethod
    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        """Read each object into its writable buffer.

        Per object: bytes read, `MISSING`, or `WRONG_SIZE` when it does not fit the buffer.
        """

    def batch_remove(self, keys: list[str]) -> None:
        """Remove each key's object, if any, so that the next write of the key stores it afresh.

        For a store that heals (see `transfer/page_store.py`): writes skip a key already held, so
        an object that fails verification stays until removed. Absent keys are fine; an outage
        raises StorageError. By default nothing is removed: such a store keeps its damaged
        objects, which stay misses.
        """

    def evicted(self) -> list[str]:
        """Keys this adapter removed to make room since the last call (drained), so a caller
        that announced them stored can withdraw them. A store that evicts out of sight (a
        server's policy) returns none."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release connections and memory; later calls are errors."""

    def register_memory(self, view: memoryview) -> None:
        """Hint that `view` will be a source or destination again (zero-copy backends pin it)."""

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        """Like batch_set, each object given as the concatenation of its parts.

        `ready(i)`, when given, must be called before any part of object i is read, and only
        for objects that will be transferred: the caller may still be filling them (a checksum
        header computed beside the transfer, a sealed body) and ready blocks until they are
        final. An adapter that sees an object is already stored may skip it, uncalled, as a
        success.
        """
        if ready is not None:
            for i in range(len(keys)):
                ready(i)
        return self.batch_set(keys, [b"".join(p) for p in parts])

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        landed: Callable[[int, list[int]], None] | None = None) -> list[int]:
        """Like batch_get, each object scattered over its parts in order.

        An object larger than its parts is `WRONG_SIZE`; one smaller reports the bytes it holds
        (fewer than the parts'), leaving the parts' contents unspecified. `landed(start,
        results)`, when given, is called as each run of objects is in place (their results as
        batch_get would give them), so the caller can verify them while the bytes are still in
        cache and the rest are in flight. Runs arrive in order and cover the whole batch.
        """
        sizes = [sum(p.nbytes for p in ps) for ps in parts]
        staging = [memoryview(bytearray(n)) for n in sizes]
        got = self.batch_get(keys, staging)
        out = []
        for ps, buf, n, size in zip(parts, staging, got, sizes):
            if call_abandoned():     # the caller has moved on: its buffers are not ours to fill
                n = MISSING
            if n == size:
                offset = 0
                for p in ps:
                    memoryview(p).cast("B")[:] = buf[offset:offset + p.nbytes]
                    offset += p.nbytes
            out.append(n)
        if landed is not None:
            landed(0, out)
        return out

    def __enter__(self) -> "StorageAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def storage_names() -> list[str]:
    """Every backend registered in the `hicache_async.storage` entry points, ours or installed."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def storage_backend(name: str) -> type[StorageAdapter]:
    """The adapter class registered under `name` in the `hicache_async.storage` entry points."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise UsageError(f"unknown storage {name!r}: known backends are {known}")
    try:
        return found[name].load()
    except ImportError as exc:
        raise UsageError(f"storage {name!r} cannot be loaded: {exc}") from None


def open_storage(name: str, **options) -> StorageAdapter:
    """The adapter registered under `name`, constructed with `options` (a session's yield)."""
    return storage_backend(name)(**options)
