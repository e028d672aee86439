"""SGLang's own per-step metrics hook reads our backend: after real backups and prefetches
through its controller, `get_stats` is the `StorageMetrics` its collector logs as histograms
under the labels SGLang builds, one interval at a time; our store's failures, which it has no
field for, reach the log once each."""
import logging
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from tests.plugins.sglang import harness as h
from tests.plugins.sglang.test_keys_and_misses import HASHES, _object, _stored, backend, slots


def _tree(ctl) -> SimpleNamespace:
    """The radix cache's state its per-step hook reads, with nothing of its own to poll, and
    the storage collector SGLang's attachment builds for it."""
    tree = SimpleNamespace(linker=None, cache_controller=ctl, enable_storage=True, buffer_pipeline=None,
                           enable_storage_metrics=True, storage_metrics_collector=None,
                           _drain_async_work=lambda: None, flush_pending_backups=lambda: None,
                           _sync_hicache_ready_counts=lambda: (0, 0, [], []),
                           writing_check=lambda finish_count: None, loading_check=lambda finish_count: None,
                           prefetch_outcome_stats_snapshot=dict)
    tree.storage_metrics_collector = StorageAttachment(tree)._resolve_metrics_collector("dynamic", None)
    return tree


@pytest.mark.timeout(60)
def test_sglangs_metrics_step_logs_our_batches_once(dynamic):
    pool = h.host_pool("mha", "page_first")
    tokens = list(range(700, 700 + 6 * h.PAGE))
    with h.controller(pool, "dynamic", dynamic, metrics=True) as ctl:
        tree = _tree(ctl)
        labels = {k: str(v) for k, v in tree.storage_metrics_collector.labels.items()}

        def sample(name: str) -> float:
            return REGISTRY.get_sample_value(f"sglang:{name}", labels)

        slots = pool.alloc(6 * h.PAGE)
        assert h.back_up(ctl, tokens, slots) == 6 * h.PAGE
        pool.free(slots)
        assert h.prefetch(ctl, pool, tokens)[0] == 6 * h.PAGE
        UnifiedRadixCache.check_hicache_events(tree)
        for kind in ("backup", "prefetch"):
            assert (sample(f"{kind}_pgs_count"), sample(f"{kind}_pgs_sum")) == (1, 6)
            assert sample(f"{kind}_bandwidth_count") == 1 and sample(f"{kind}_bandwidth_sum") > 0
        assert labels["storage_backend"] == "dynamic" and labels["tp_rank"] == "0"
        assert h.back_up(ctl, tokens, pool.alloc(6 * h.PAGE)) == 6 * h.PAGE    # all stored already: 0 written
        UnifiedRadixCache.check_hicache_events(tree)
        assert sample("backup_pgs_count") == sample("prefetch_pgs_count") == 1


@pytest.mark.timeout(60)
def test_our_failures_reach_the_log_once(tmp_path, caplog):
    extra = _stored(tmp_path)
    victim = _object(tmp_path / "l3", HASHES[2])
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 1
    victim.write_bytes(bytes(blob))
    reader = backend(h.host_pool("mha", "page_first", pages=4), extra)
    assert reader.batch_get_v1(HASHES, slots()) == [True, True, False, False]
    with caplog.at_level(logging.INFO, logger="hicache_sglang"):
        first = reader.get_stats()
        reader.get_stats()
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache_sglang.figures"]
    assert len(lines) == 1 and "since last reported: corrupt_objects 1;" in lines[0]
    assert first.prefetch_pgs == [] and first.backup_pgs == []      # metrics off: nothing kept for SGLang
