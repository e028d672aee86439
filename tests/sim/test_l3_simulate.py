"""L3 across real ranks: pools small enough to push KV to storage give L3 hits, and tokens
still equal the cache-less single-rank reference. File storage and a real mooncake_master."""
import pytest

from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.sim.jobs.simulate_rank import payload_of
from hicache_async.sim.ranks.launcher import launch
from tests.helpers.reference_kv import assert_like_reference, reference

SPEC = WorkloadSpec(requests=24, turns=4, system_prompts=2, system_len=32, user_len=(8, 16),
                    max_new=4, concurrency=6)
CACHE = dict(device_pages=24, host_pages=40, page_size=8, prefetch_threshold=8, sync_timeout_s=60)
REFERENCE, KV_REFERENCE = reference(ModelConfig(), SPEC, CACHE["page_size"])
TOPOLOGIES = [(2, 2, 1), (1, 1, 2)]


def _check(results, runs):
    for name in runs:
        reports = [r[name] for r in results]
        first = assert_like_reference(reports, REFERENCE, name)
        assert first["tokens_from_l3"] > 0, (name, first)
        assert sum(r["storage_errors"] for r in reports) == 0, name


def _runs(storage: dict) -> dict:
    runs = {scheme: payload_of(ModelConfig(), CacheConfig(key_scheme=scheme, **CACHE), SPEC, storage)
            for scheme in ("rank-suffix", "unified")}
    for payload in runs.values():
        payload["kv_reference"] = KV_REFERENCE
    return runs


@pytest.mark.parametrize("tp,pp,cp", TOPOLOGIES)
def test_file_storage_serves_l3_across_ranks(tp, pp, cp, tmp_path):
    runs = _runs({"name": "file", "options": {}})
    for scheme, payload in runs.items():     # one directory per scheme: hits must come from this run
        payload["storage"]["options"] = {"path": str(tmp_path / scheme)}
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.sim_targets:matrix", payload={"runs": runs},
                     timeout_s=60)
    _check(results, runs)


@pytest.mark.parametrize("tp,pp,cp", TOPOLOGIES)
def test_mooncake_serves_l3_across_ranks(tp, pp, cp, mooncake_master):
    runs = _runs({"name": "mooncake", "options": {"master": mooncake_master.address,
                                                   "metadata_url": mooncake_master.metadata_url}})
    # The master outlives one topology: under unified keys the second topology may also hit
    # the first one's objects, which is the point of topology-free keys.
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.sim_targets:matrix", payload={"runs": runs},
                     timeout_s=60)
    _check(results, runs)
