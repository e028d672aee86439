"""Completion events: `query()` never blocks, `wait()` is awaited with a timeout.

Every transfer completes on one of these, on CPU and GPU alike, so the ack queues and
the agreement run the same code whether or not CUDA is present.
"""
from __future__ import annotations

import asyncio
import threading
import time

import anyio

from .errors import bounded

_SPIN_S = 2e-4      # poll with bare yields this long before backing off
_MAX_SLEEP_S = 1e-3


class CompletionEvent:
    """Base: subclasses say whether the work is done; waiting is shared.

    A completed event may carry an `error`: the work failed and its data must not be used.
    """

    error: BaseException | None = None

    def query(self) -> bool:
        raise NotImplementedError

    async def wait(self, timeout_s: float, what: str) -> None:
        """Await completion without blocking the loop; raise SyncTimeout naming `what`."""
        if self.query():
            return
        with bounded(timeout_s, what):
            await self._poll()

    async def _poll(self) -> None:
        """Bare yields at first, then sleeps that double up to a millisecond."""
        start = time.perf_counter()
        delay = 0.0
        while not self.query():
            if time.perf_counter() - start > _SPIN_S:
                delay = min(_MAX_SLEEP_S, max(delay * 2, 5e-5))
            await anyio.sleep(delay)


class HostEvent(CompletionEvent):
    """Set by a worker thread when a host-side copy or storage call finishes.

    Waiters are woken by the setter through their loop, so awaiting one costs no polling.
    Done is a flag under a lock, not a `threading.Event`: a CPU copy makes one event per
    layer on the scheduler's thread, and a `threading.Event` costs 40 times a lock to make.
    """

    __slots__ = ("_done", "_lock", "_waiters", "error", "set_at")

    def __init__(self) -> None:
        self._done = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, anyio.Event]] = []
        self.error: BaseException | None = None
        self.set_at: float | None = None    # perf_counter when the work finished: for throughput

    def fail(self, error: BaseException) -> None:
        """Complete with an error: the work will never happen, so waiters must not wait for it."""
        self.error = error
        self.set()

    def set(self) -> None:
        self.set_at = time.perf_counter()
        with self._lock:
            self._done = True
            waiters, self._waiters = self._waiters, []
        for loop, woken in waiters:
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:     # that loop has closed: its waiter is gone
                pass

    def query(self) -> bool:
        return self._done

    def subscribe(self, woken: anyio.Event) -> bool:
        """Have set() wake `woken` on the running loop; False (and nothing kept) if already set."""
        with self._lock:
            if self._done:
                return False
            self._waiters.append((asyncio.get_running_loop(), woken))
            return True

    def unsubscribe(self, woken: anyio.Event) -> None:
        """Forget `woken`: a wait that timed out must not leave a waiter for set() to wake (an
        idle loop waits on a long storage op's event many times over)."""
        with self._lock:
            self._waiters = [w for w in self._waiters if w[1] is not woken]

    async def wait(self, timeout_s: float, what: str) -> None:
        woken = anyio.Event()
        if not self.subscribe(woken):
            return
        try:
            with bounded(timeout_s, what):
                await woken.wait()
        finally:
            self.unsubscribe(woken)


async def first_completion(events: list[CompletionEvent], timeout_s: float) -> None:
    """Return once any of `events` completes, or after `timeout_s`, without raising: the
    caller checks what completed. Host events wake it; others are polled at most every ms."""
    if not events or any(e.query() for e in events):
        return
    with anyio.move_on_after(timeout_s):
        if not all(isinstance(e, HostEvent) for e in events):
            # a device event cannot wake us: poll, as CompletionEvent does
            while not any(e.query() for e in events):
                await anyio.sleep(_MAX_SLEEP_S)
            return
        woken = anyio.Event()
        try:
            if all(e.subscribe(woken) for e in events):
                await woken.wait()
        finally:
            for e in events:
                e.unsubscribe(woken)
