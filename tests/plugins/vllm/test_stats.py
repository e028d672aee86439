"""The stats payload vLLM adds across workers and intervals: counts sum, per-call seconds
concatenate, gauges keep each worker process's latest value."""
from __future__ import annotations

from hicache_vllm.stats import Deltas, HiCacheStats, Observed


def test_counts_add_samples_concatenate_and_gauges_keep_each_workers_latest():
    a = HiCacheStats({"l3_read_pages": 2, "l3_read_seconds": [0.1], "backup_queue_pages": {"1": 4}})
    b = HiCacheStats({"l3_read_pages": 3, "l3_read_seconds": [0.2, 0.3], "backup_queue_pages": {"2": 5}})
    later = HiCacheStats({"backup_queue_pages": {"1": 0}})
    merged = a.aggregate(b).aggregate(later)
    assert merged.data == {"l3_read_pages": 5, "l3_read_seconds": [0.1, 0.2, 0.3],
                           "backup_queue_pages": {"1": 0, "2": 5}}
    reduced = merged.reduce()
    assert reduced["backup_queue_pages"] == 5 and reduced["l3_read_seconds_calls"] == 3
    assert abs(reduced["l3_read_seconds_mean"] - 0.2) < 1e-9


def test_an_interval_drains_the_samples_and_reports_the_queue_when_it_moved():
    observed, queue = Observed(), [0]
    observed.timed(None, lambda: queue[0])
    deltas = Deltas(observed)
    assert deltas.take({}) is None                              # an idle worker: nothing to say
    observed.record("l3_write_seconds", 0.5)
    queue[0] = 3
    first = deltas.take({"l3_stored_pages": 2}).data
    assert first["l3_write_seconds"] == [0.5] and list(first["backup_queue_pages"].values()) == [3]
    assert deltas.take({"l3_stored_pages": 2}) is None          # nothing new: no samples, the same queue
    queue[0] = 0
    assert list(deltas.take({"l3_stored_pages": 2}).data["backup_queue_pages"].values()) == [0]
