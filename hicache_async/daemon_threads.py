"""Daemon threads for calls that may block for good: a hung storage call, a wait on a dead peer.

A call runs on an idle thread, or a new one when none is idle, so a call stuck forever costs one
thread, never the caller nor an unrelated call queued behind it; idle threads are reused rather
than piling up. Daemon, so a stuck call never holds up process exit.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class DaemonThreads:
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], object]) -> Future:
        """Run `call` on a daemon thread; its result or exception lands in the returned future."""
        future: Future = Future()
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        self._jobs.put((call, future))
        return future

    def _serve(self) -> None:
        while True:
            call, future = self._jobs.get()
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever holds the future
                future.set_exception(exc)
            with self._lock:
                self._idle += 1
