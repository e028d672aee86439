"""Cached outputs equal cache-less outputs on seeded workloads with pools small enough to evict."""
import pytest

from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.hicache.plugin import HiCachePlugin
from tests.helpers.engine_run import assert_matches_reference

SPEC = dict(requests=16, turns=4, system_len=48, user_len=(8, 24), max_new=6)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_policies_reuse_l2_and_match(policy, attention):
    plugin = HiCachePlugin(CacheConfig(device_pages=24, host_pages=64, write_policy=policy))
    report = assert_matches_reference(plugin, WorkloadSpec(seed=3, **SPEC), ModelConfig(attention=attention))
    assert report["tokens_from_l2"] > 0, report
    assert report["tokens_from_l1"] > 0, report
    assert report["transfers"]["load"] > 0 and report["transfers"]["write"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_host_pool_drops_cache_but_never_tokens(seed):
    """A host pool smaller than the working set forces host eviction and drops."""
    plugin = HiCachePlugin(CacheConfig(device_pages=20, host_pages=8, write_policy="write_back"))
    report = assert_matches_reference(plugin, WorkloadSpec(seed=seed, **SPEC), ModelConfig(seed=seed))
    assert report["dropped_pages"] > 0, report


def test_load_back_threshold_recomputes_short_host_hits():
    plugin = HiCachePlugin(CacheConfig(device_pages=24, host_pages=64, load_back_threshold=10_000))
    report = assert_matches_reference(plugin, WorkloadSpec(seed=3, **SPEC), ModelConfig())
    assert report["tokens_from_l2"] == 0 and report["transfers"]["load"] == 0
