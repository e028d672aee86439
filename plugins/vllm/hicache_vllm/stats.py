"""What the connector tells vLLM's stats each interval, which vLLM adds across workers and
the scheduler, logs, and hands to our Prometheus metrics (`prom.py`):

- counts (`int`): each interval's increase of a running total (pages, tokens, bytes, rejected
  objects, failed calls); summed;
- samples (`observed.SAMPLES`, lists of seconds, one per L3 call): concatenated, so a histogram sees
  every call of every worker;
- samples of the scheduler (`ttft_<tier>_seconds`: a request's first token, by the tier that
  served most of its prompt): concatenated likewise;
- gauges (`backup_queue_pages`, {worker process: value}; the scheduler's cost estimates,
  {"scheduler": value}): each worker's current value, sent
  every interval, moved or not: vLLM hands `prom.py` each step's stats merged over the
  workers that sent them, so a worker left out would drop out of the sum; merged across
  intervals, the latest value per process wins, and the log sums them.

A worker's L3 call times and backup queue are observed in its process (`observed.py`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .observed import OBSERVED, Observed


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


class Deltas:
    """What changed since the last `take`: running totals as increases, and this process's
    samples and gauges (`OBSERVED`)."""

    def __init__(self, observed: Observed = OBSERVED) -> None:
        self._last: Counter = Counter()
        self.observed = observed

    def take(self, totals: dict[str, int], extra: dict | None = None) -> HiCacheStats | None:
        """`extra`: the caller's own samples and gauges, passed through."""
        now = Counter({k: v for k, v in totals.items() if v})
        data = dict(now - self._last)
        self._last = now
        data.update(self.observed.take())
        data.update(extra or {})
        return HiCacheStats(data) if data else None
