"""Per-tier counts for vLLM's connector stats: each interval's sums, which vLLM adds across
workers and the scheduler and logs, so an operator sees where prefixes came from and what L3
refused (corrupt, forged, missing objects, failed calls)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class HiCacheStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "HiCacheStats":
        return HiCacheStats(dict(Counter(self.data) + Counter(other.data)))

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Deltas:
    """What changed in a set of running totals since the last `take`."""

    def __init__(self) -> None:
        self._last: Counter = Counter()

    def take(self, totals: dict[str, int]) -> HiCacheStats | None:
        now = Counter({k: v for k, v in totals.items() if v})
        delta = now - self._last
        self._last = now
        return HiCacheStats(dict(delta)) if delta else None
