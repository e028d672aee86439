"""A worker's L3 call times and backup queue, observed in its process: vLLM asks the connector
for stats (`stats.py`), not the worker's parts. No vLLM here: the worker side runs without it.
"""
from __future__ import annotations

import os
import socket
import threading
import time

from hicache_async.storage.wrapping import WrappingStorage

SAMPLES = ("l3_read_seconds", "l3_write_seconds")
MAX_SAMPLES = 4096      # per kind and interval (one engine step): the rest of a flood is dropped
_OPS = {"batch_get": "l3_read_seconds", "batch_set": "l3_write_seconds"}


class Observed:
    """This process's L3 call seconds since the last interval, and its backup queue; `worker`
    names it among the workers (host and pid: Ray may place two workers with one pid on two
    hosts)."""

    def __init__(self, worker: str = f"{socket.gethostname()}/{os.getpid()}") -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {name: [] for name in SAMPLES}
        self._queue = None      # () -> pages the worker's backups still read

    def timed(self, adapter, backup_queue) -> "TimedStorage":
        """`adapter`, each read and write timed; `backup_queue()` is the worker's queue depth."""
        self._queue = backup_queue
        return TimedStorage(adapter, self)

    def record(self, name: str, seconds: float) -> None:
        with self._lock:
            if len(self._samples[name]) < MAX_SAMPLES:
                self._samples[name].append(seconds)

    def take(self) -> dict:
        """The samples since the last take (drained), and the gauges now, moved or not."""
        with self._lock:
            out = {name: samples for name, samples in self._samples.items() if samples}
            self._samples = {name: [] for name in SAMPLES}
        if self._queue is not None:
            out["backup_queue_pages"] = {self.worker: self._queue()}
        return out


OBSERVED = Observed()


class TimedStorage(WrappingStorage):
    """Times every read (`batch_get`) and write (`batch_set`) call, failed or not: a call that
    ran into its deadline is the latency a request waited."""

    def __init__(self, inner, observed: Observed) -> None:
        super().__init__(inner)
        self.observed = observed

    def _through(self, op: str, keys: list[str], call):
        name = _OPS.get(op)
        if name is None:
            return call()
        started = time.perf_counter()
        try:
            return call()
        finally:
            self.observed.record(name, time.perf_counter() - started)
