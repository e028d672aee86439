"""What SGLang's metrics step reads from a storage backend, and what it has no room for.

SGLang's radix cache calls `get_stats()` every scheduler step while storage metrics are on,
sets `prefetch_stats` on what it gets and hands it to `StorageMetricsCollector`, which
asserts a `StorageMetrics`: per-interval lists of pages a batch moved and the batch's
bandwidth, emptied by each call. Its backends count a read's pages and bytes, a write's
pages and bytes less what storage already held, in GB of 2^30 bytes over the call's wall
time; so do we. Our store's own figures (objects found corrupt, forged or missing, failed
storage calls, bytes each way) have no field there, so they go to the log: failures as they
appear (healed objects with them), traffic at most once a minute.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)
GB = 1 << 30              # SGLang's backends' GB
TRAFFIC_LOG_S = 60.0
FAILURES = ("corrupt_objects", "forged_objects", "missing_objects", "storage_errors", "healed_objects")
TRAFFIC = ("bytes_written", "bytes_read")


class IntervalFigures:
    """Batches recorded by the data path's threads, taken by the scheduler's metrics step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._lists = self._empty()
        self._logged = dict.fromkeys(FAILURES + TRAFFIC, 0)
        self._traffic_at = time.monotonic()

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}

    def record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        """One batch of `kind` ("prefetch" or "backup") that moved `pages` pages of `nbytes`."""
        if self.enabled and pages:
            with self._lock:
                self._lists[f"{kind}_pgs"].append(pages)
                self._lists[f"{kind}_bandwidth"].append(nbytes / GB / max(seconds, 1e-9))

    def take(self, counters):
        """The batches since the last call, as SGLang's `StorageMetrics`; logs `counters`' news."""
        # imported here: its module loads model code, and SGLang's metrics step, the caller, has loaded it
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            lists, self._lists = self._lists, self._empty()
        if counters is not None:
            self._log(counters)
        return StorageMetrics(**lists)

    def _log(self, counters) -> None:
        now = {name: getattr(counters, name) for name in FAILURES + TRAFFIC}
        news = {name: now[name] - self._logged[name] for name in now}
        if any(news[name] for name in FAILURES):
            log.warning("hicache-async: L3 since last reported: %s; totals %s",
                        _pairs(news, [name for name in FAILURES if news[name]]), _pairs(now, FAILURES + TRAFFIC))
        elif any(news[name] for name in TRAFFIC) and time.monotonic() - self._traffic_at >= TRAFFIC_LOG_S:
            log.info("hicache-async: L3 totals %s", _pairs(now, FAILURES + TRAFFIC))
        else:
            return
        self._logged, self._traffic_at = now, time.monotonic()


def _pairs(values: dict, names) -> str:
    return ", ".join(f"{name} {values[name]}" for name in names)
