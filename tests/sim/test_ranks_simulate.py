"""Across real ranks, cached generation equals a cache-less single-rank run, with L2 reuse.

One launch per topology runs mha and mla under every write policy, so the matrix costs six
process starts, not thirty-six.
"""
import pytest

from hicache_async.config import WRITE_POLICIES, CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.errors import DivergenceError
from hicache_async.parallel.pp_sync import REAP_AGE_STEPS
from hicache_async.sim.jobs.simulate_rank import payload_of
from hicache_async.sim.ranks.launcher import launch
from tests.helpers.reference_kv import assert_like_reference, reference

SPEC = WorkloadSpec(requests=8, turns=4, system_prompts=1, system_len=32, user_len=(8, 16),
                    max_new=4, concurrency=2)
CACHE = dict(device_pages=14, host_pages=32, page_size=8)
REFERENCE = {att: reference(ModelConfig(attention=att), SPEC, CACHE["page_size"]) for att in ("mha", "mla")}


@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)])
def test_cached_tokens_match_reference_across_ranks(tp, pp, cp):
    runs = {f"{att}/{policy}": payload_of(ModelConfig(attention=att),
                                          CacheConfig(write_policy=policy, sync_timeout_s=60, **CACHE),
                                          SPEC, None)
            for att in ("mha", "mla") for policy in WRITE_POLICIES}
    for name, payload in runs.items():
        payload["kv_reference"] = REFERENCE[name.split("/")[0]][1]
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.sim_targets:matrix", payload={"runs": runs},
                     timeout_s=60)
    for name in runs:
        reports = [r[name] for r in results]
        first = assert_like_reference(reports, REFERENCE[name.split("/")[0]][0], name)
        assert first["tokens_from_l2"] > 0, (name, first)
        assert all(r["transfers"] == first["transfers"] for r in reports), name
        # Each step, every rank past stage 0 received one message, and sends in flight stay bounded.
        sync = [r["pp_sync"] for r in reports]
        received = first["steps"] * (len(reports) - len(reports) // pp)
        assert sum(s["sent"] for s in sync) == sum(s["received"] for s in sync) == received, name
        assert max(r["most_pending_sends"] for r in reports) <= REAP_AGE_STEPS, name


def test_a_divergent_cache_decision_on_one_rank_is_caught():
    payload = payload_of(ModelConfig(), CacheConfig(sync_timeout_s=30, **CACHE), SPEC, None)
    payload["odd_rank"] = 2
    with pytest.raises(DivergenceError, match=r"cache divergence at step \d+: rank 2 made different"):
        launch(tp=1, pp=1, cp=3, target="tests.helpers.sim_targets:skip_one_insert", payload=payload,
               timeout_s=30)
