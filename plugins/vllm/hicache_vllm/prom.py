"""Prometheus metrics of the connector, on vLLM's `/metrics` beside its own, labelled by
model and engine as vLLM labels its metrics (`KVConnectorPromMetrics`).

vLLM's front end builds this class (`HiCacheConnector.build_prom_metrics`) and hands it each
step's stats, summed over the workers and the scheduler (`stats.py`). Pages and bytes are
summed over workers: each TP rank and PP stage moves its own share of every page.
"""
from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

# L3 calls run from well under a millisecond (memory, a page cache hit) to the storage deadline
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PAGES = {"host_saved_pages": "saved", "host_loaded_pages": "loaded", "l3_stored_pages": "backed_up",
         "l3_read_pages": "read", "l3_looked_pages": "looked_up", "l3_prefetched_pages": "prefetched",
         "failed_saves": "dropped", "l3_declined_pages": "declined"}
REJECTED = {"l3_corrupt_objects": "corrupt", "l3_forged_objects": "forged", "l3_missing_objects": "missing"}
BYTES = {"l3_bytes_written": "write", "l3_bytes_read": "read"}
LATENCY = {"l3_read_seconds": "read", "l3_write_seconds": "write"}
TTFT = {f"ttft_{tier}_seconds": tier for tier in ("device", "host", "l3", "none")}
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ESTIMATES = {"l3_read_latency_seconds": "An L3 read's fixed cost, as the prefetch decision estimates it.",
             "l3_read_seconds_per_page": "Seconds each page adds to an L3 read, as the prefetch decision "
                                         "estimates it.",
             "prefill_seconds_per_token": "Seconds each token adds to a forward pass, as the prefetch decision "
                                          "estimates it."}


class HiCachePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = self._labelnames
        self.tokens = self._counter_cls(
            name="vllm:hicache_prefix_tokens", labelnames=[*names, "tier"],
            documentation="Prompt tokens served from hicache's tiers, by where they came from: host (the "
                          "host tier) or l3 (read from storage into the host tier for this request).")
        self.ttft = self._histogram_cls(
            name="vllm:hicache_time_to_first_token_seconds", labelnames=[*names, "tier"], buckets=TTFT_BUCKETS,
            documentation="Seconds from a request's arrival to its first token, by the tier that served most of "
                          "its prompt: device (vLLM's prefix cache), host, l3, or none (computed).")
        self.estimates = {key: self._gauge_cls(name=f"vllm:hicache_{key}", labelnames=names,
                                               multiprocess_mode="mostrecent", documentation=doc)
                          for key, doc in ESTIMATES.items()}
        self.pages = self._counter_cls(
            name="vllm:hicache_pages", labelnames=[*names, "op"],
            documentation="Pages moved, summed over workers: saved (device to host), loaded (host to "
                          "device), backed_up (host to L3), read (L3 to host, verified), dropped (a save "
                          "whose copy failed or that was computed over a failed load: its slot freed); and, "
                          "once for all workers, looked_up (looked for in L3) and prefetched (from L3 into "
                          "the host tier).")
        self.bytes = self._counter_cls(
            name="vllm:hicache_l3_bytes", labelnames=[*names, "direction"],
            documentation="Bytes written to and read from L3, summed over workers.")
        self.rejected = self._counter_cls(
            name="vllm:hicache_l3_rejected_objects", labelnames=[*names, "reason"],
            documentation="L3 objects refused as KV: corrupt (checksum or header), forged (failed "
                          "authentication in a sealed store) or missing (absent from a page that was read).")
        self.healed = self._counter_cls(
            name="vllm:hicache_l3_healed_objects", labelnames=names,
            documentation="Damaged L3 objects removed and written afresh by a backup.")
        self.failed = self._counter_cls(
            name="vllm:hicache_l3_failed_calls", labelnames=names,
            documentation="L3 calls that failed or ran past storage_timeout (each a miss, never an error).")
        self.queue = self._gauge_cls(
            name="vllm:hicache_backup_queue_pages", labelnames=names, multiprocess_mode="mostrecent",
            documentation="Host pages that issued backups still read, summed over workers.")
        self.seconds = self._histogram_cls(
            name="vllm:hicache_l3_call_seconds", labelnames=[*names, "op"], buckets=SECONDS_BUCKETS,
            documentation="Seconds per L3 call (a batch of objects), by op: read or write.")
        for engine in per_engine_labelvalues.values():     # every series from the start: zero, never absent
            for metric, labels in ((self.tokens, ("host", "l3")), (self.pages, PAGES.values()),
                                   (self.rejected, REJECTED.values()), (self.bytes, BYTES.values()),
                                   (self.seconds, LATENCY.values()), (self.ttft, TTFT.values())):
                for label in labels:
                    metric.labels(*engine, label)
            for metric in (self.healed, self.failed, self.queue, *self.estimates.values()):
                metric.labels(*engine)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's stats; keys this version does not know are skipped, never an error
        in the front end."""
        engine = self.per_engine_labelvalues[engine_idx]
        data = transfer_stats_data
        host, l3 = data.get("host_hit_tokens", 0), data.get("l3_hit_tokens", 0)
        for tier, n in (("host", host - l3), ("l3", l3)):
            if n > 0:
                self.tokens.labels(*engine, tier).inc(n)
        for metric, names in ((self.pages, PAGES), (self.rejected, REJECTED), (self.bytes, BYTES)):
            for key, label in names.items():
                if data.get(key):
                    metric.labels(*engine, label).inc(data[key])
        for metric, key in ((self.healed, "l3_healed_objects"), (self.failed, "l3_errors")):
            if data.get(key):
                metric.labels(*engine).inc(data[key])
        if "backup_queue_pages" in data:
            self.queue.labels(*engine).set(sum(data["backup_queue_pages"].values()))
        for key, gauge in self.estimates.items():
            if key in data:
                gauge.labels(*engine).set(sum(data[key].values()))
        for histogram, keys in ((self.seconds, LATENCY), (self.ttft, TTFT)):
            for key, label in keys.items():
                child = histogram.labels(*engine, label)
                for seconds in data.get(key, ()):
                    child.observe(seconds)
