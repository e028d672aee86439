"""The stats payload vLLM adds across workers and intervals: counts sum, per-call seconds
concatenate, gauges keep each worker process's latest value; and the backup queue as vLLM's
own merging hands it to our Prometheus gauge and its log, step by step."""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from hicache_vllm.connector import HiCacheConnector
from hicache_vllm.prom import HiCachePromMetrics
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


def test_an_interval_drains_the_samples_and_reports_the_queue_moved_or_not():
    observed, queue = Observed("w0"), [0]
    deltas = Deltas(observed)
    assert deltas.take({}) is None                              # no store: nothing to say
    observed.timed(None, lambda: queue[0])
    assert deltas.take({}).data == {"backup_queue_pages": {"w0": 0}}
    observed.record("l3_write_seconds", 0.5)
    queue[0] = 3
    assert deltas.take({"l3_stored_pages": 2}).data == {
        "l3_stored_pages": 2, "l3_write_seconds": [0.5], "backup_queue_pages": {"w0": 3}}
    assert deltas.take({"l3_stored_pages": 2}).data == {"backup_queue_pages": {"w0": 3}}    # unmoved: sent
    queue[0] = 0
    assert deltas.take({"l3_stored_pages": 5}).data == {"l3_stored_pages": 3, "backup_queue_pages": {"w0": 0}}


def test_a_queue_of_zeros_is_empty_for_the_log_and_one_of_pages_is_not():
    assert HiCacheStats({"backup_queue_pages": {"w0": 0, "w1": 0}}).is_empty()
    assert not HiCacheStats({"backup_queue_pages": {"w0": 0, "w1": 2}}).is_empty()
    assert not HiCacheStats({"l3_read_pages": 1, "backup_queue_pages": {"w0": 0}}).is_empty()


def _prom() -> HiCachePromMetrics:
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Gauge, Counter, Histogram)}
    return HiCachePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})


def _step(aggregator: KVOutputAggregator, workers: list[Deltas]) -> dict:
    """One engine step: each worker's stats, merged by vLLM's own aggregator, as the front end
    gets them."""
    outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_connector_stats=w.take({})))
               for w in workers]
    return aggregator.aggregate(outputs).kv_connector_output.kv_connector_stats.data


def test_the_backup_queue_gauge_sums_every_worker_every_step_through_vllms_merging():
    depths = {"w0": 0, "w1": 0}
    workers = []
    for name in depths:
        observed = Observed(name)
        observed.timed(None, lambda name=name: depths[name])
        workers.append(Deltas(observed))
    prom, aggregator = _prom(), KVOutputAggregator(expected_finished_count=2)
    log = KVConnectorLogging(None)
    log.connector_cls = HiCacheConnector
    gauge = prom.queue.labels("0")
    assert gauge._value.get() == 0 and prom.rejected.labels("0", "forged")._value.get() == 0     # present, zero
    seen = []
    for w0, w1 in ((4, 0), (4, 7), (4, 2), (0, 2)):     # each step one worker's depth moves, the other's not
        depths.update(w0=w0, w1=w1)
        data = _step(aggregator, workers)
        prom.observe(data)
        log.observe(data)
        seen.append(gauge._value.get())
    assert seen == [4, 11, 6, 2]
    assert log.transfer_stats_accumulator.reduce() == {"backup_queue_pages": 2}     # the log's interval: the latest
