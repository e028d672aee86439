"""An adapter wrapper that turns a dead or hung backend into fast storage errors.

Without it, a backend whose server died makes every call wait out the client's own retries
(Mooncake: about 4 s each), and one that hangs stalls its op, and the step that retires it,
for good. Two guards, around every backend:

- a deadline: each call runs on a runner thread and the caller stops waiting after
  `storage_timeout_s`, so a call that never returns becomes a StorageError, an
  `AbandonedCall` that says when the call really returns. The abandoned call keeps its
  thread (a daemon: it never blocks exit) and is told (`call_abandoned`), so it starts
  nothing more; what it already started may still land in the buffers it was given, which
  their owner keeps from other data until then (`staging.py`);
- a circuit breaker: after `storage_breaker_failures` consecutive failed calls, calls fail
  at once. After `storage_retry_s` one of them starts a probe in the background (one cheap
  `batch_exists` under the same deadline) instead of going through itself, so no real
  transfer waits on a backend that is still down; the first probe that answers closes it.
  A probe only shows the backend answers, not that its transfers do (a store whose index
  answers while its data path hangs): so a breaker a probe closed is half open, and its
  next failure opens it again at once; each time it opens or a probe fails without a real
  call succeeding between, the wait before the next probe doubles, up to `MAX_BACKOFF`
  times `storage_retry_s`. Without that, such a store costs a deadline or two every
  `storage_retry_s` for the whole run.

A failed call is a StorageError either way, which the page store counts and the cache
carries on without: L1 and L2 keep serving.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from ..config import CacheConfig
from ..daemon_threads import DaemonThreads
from ..errors import StorageError
from .base import AbandonedCall, StorageAdapter, run_abandonable
from .wrapping import WrappingStorage

log = logging.getLogger(__name__)
PROBE_KEY = "hicache-async-probe"
MAX_BACKOFF = 32     # the longest wait before a probe, in units of storage_retry_s


_RUNNERS = DaemonThreads("hicache-storage-call")   # shared by every guard in the process


class GuardedStorage(WrappingStorage):
    def __init__(self, inner: StorageAdapter, config: CacheConfig) -> None:
        super().__init__(inner)
        self.timeout_s = config.storage_timeout_s
        self.failures_to_open = config.storage_breaker_failures
        self.retry_s = config.storage_retry_s
        self._lock = threading.Lock()
        self._failures = 0
        self._open_reason: str | None = None   # set while the breaker is open
        self._retry_at = 0.0
        self._backoff = self.retry_s          # wait before the next probe, doubled on each failure
        self._probing = False
        self.opened = 0                        # times the breaker opened

    # -- the two guards ------------------------------------------------------------------

    def _call(self, op: str, call: Callable[[], object]):
        self._admit()
        try:
            result = self._bounded(op, call)
        except StorageError as exc:
            self._failed(exc)
            raise
        with self._lock:
            self._failures, self._backoff = 0, self.retry_s
        return result

    def _bounded(self, op: str, call: Callable[[], object]):
        abandoned = threading.Event()
        future = _RUNNERS.submit(lambda: run_abandonable(abandoned, call))
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            abandoned.set()
            raise AbandonedCall(f"storage {op} still running after {self.timeout_s:g} s; given up on",
                                future) from None

    def _admit(self) -> None:
        with self._lock:
            if self._open_reason is None:
                return
            if not self._probing and time.monotonic() >= self._retry_at:
                self._probing = True
                _RUNNERS.submit(self._probe)     # its own call then runs on another runner
            reason = self._open_reason
        raise StorageError(f"storage unavailable ({reason}); failing fast until a probe answers")

    def _failed(self, exc: StorageError) -> None:
        with self._lock:
            self._failures += 1
            if self._open_reason is not None or self._failures < self.failures_to_open:
                return
            self._open_reason = f"{self._failures} calls failed in a row, the last: {exc}"
            failures, wait = self._failures, self._back_off()
            self.opened += 1
        log.warning("storage breaker open after %d failed calls (%s); the cache carries on from "
                    "L1/L2 and probes storage in %g s", failures, exc, wait)

    def _back_off(self) -> float:
        """Schedule the next probe and double the wait after it; called under the lock."""
        wait = self._backoff
        self._retry_at = time.monotonic() + wait
        self._backoff = min(2 * wait, MAX_BACKOFF * self.retry_s)
        return wait

    def _probe(self) -> None:
        try:
            self._bounded("probe", lambda: self.inner.batch_exists([PROBE_KEY]))
            answered = True
        except Exception:  # noqa: BLE001 - any failure just means: still down
            answered = False
        with self._lock:
            self._probing = False
            if answered:      # half open: one more failure opens it again
                self._open_reason, self._failures = None, self.failures_to_open - 1
            else:
                self._back_off()
        if answered:
            log.warning("storage answers again: breaker closed")

    # -- the adapter protocol --------------------------------------------------------------

    def _through(self, op: str, keys: list[str], call):
        return self._call(op, call)

    def register_memory(self, view: memoryview) -> None:
        """Guarded like a transfer: pinning may need the backend (Mooncake publishes the memory
        to its metadata server, which a hung master never answers)."""
        self._call("register_memory", lambda: self.inner.register_memory(view))

    def close(self) -> None:
        """Close the backend, under the deadline: a backend stuck in a call must not hang exit."""
        try:
            self._bounded("close", self.inner.close)
        except StorageError as exc:
            log.warning("%s; leaving it to process exit", exc)
