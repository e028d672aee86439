"""What the connector tells vLLM's stats each interval, which vLLM adds across workers and
the scheduler, logs, and hands to our Prometheus metrics (`prom.py`):

- counts (`int`): each interval's increase of a running total (pages, tokens, bytes, rejected
  objects, failed calls); summed;
- samples (`SAMPLES`, lists of seconds, one per L3 call): concatenated, so a histogram sees
  every call of every worker;
- gauges (`backup_queue_pages`, {worker process: value}): each worker's current value, sent
  every interval, moved or not: vLLM hands `prom.py` each step's stats merged over the
  workers that sent them, so a worker left out would drop out of the sum; merged across
  intervals, the latest value per process wins, and the log sums them.

A worker's L3 call times and backup queue are observed in its process (`Observed`): vLLM
asks the connector for stats, not the worker's parts.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from hicache_async.storage.wrapping import WrappingStorage

SAMPLES = ("l3_read_seconds", "l3_write_seconds")
MAX_SAMPLES = 4096      # per kind and interval (one engine step): the rest of a flood is dropped
_OPS = {"batch_get": "l3_read_seconds", "batch_set": "l3_write_seconds"}


@dataclass
class HiCacheStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "HiCacheStats":
        merged = dict(self.data)
        for key, value in other.data.items():
            mine = merged.get(key)
            if mine is None:
                merged[key] = value
            elif isinstance(value, list):
                merged[key] = mine + value
            elif isinstance(value, dict):
                merged[key] = {**mine, **value}
            else:
                merged[key] = mine + value
        return HiCacheStats(merged)

    def reduce(self) -> dict[str, int | float]:
        """One line of vLLM's log: counts, gauges summed, each sample list as its count and mean."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                out[f"{key}_calls"] = len(value)
                out[f"{key}_mean"] = round(sum(value) / len(value), 6) if value else 0.0
            elif isinstance(value, dict):
                out[key] = sum(value.values())
            else:
                out[key] = value
        return out

    def is_empty(self) -> bool:
        """Nothing moved and every gauge is zero: no log line (a gauge goes out every interval)."""
        return not any(sum(v.values()) if isinstance(v, dict) else v for v in self.data.values())


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


class Deltas:
    """What changed since the last `take`: running totals as increases, and this process's
    samples and gauges (`OBSERVED`)."""

    def __init__(self, observed: Observed = OBSERVED) -> None:
        self._last: Counter = Counter()
        self.observed = observed

    def take(self, totals: dict[str, int]) -> HiCacheStats | None:
        now = Counter({k: v for k, v in totals.items() if v})
        data = dict(now - self._last)
        self._last = now
        data.update(self.observed.take())
        return HiCacheStats(data) if data else None
