"""L3 paths across real ranks that the main matrix does not reach: each prefetch policy, MLA,
CP rank-0 transfers, ranks that fetched different amounts, and prefetches the timeout ends.
Every run must match the reference in tokens and in every cached page's KV."""
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
REFERENCE = {att: reference(ModelConfig(attention=att), SPEC, CACHE["page_size"]) for att in ("mha", "mla")}


def _payload(tmp_path, name: str, attention: str = "mha", **cache) -> dict:
    payload = payload_of(ModelConfig(attention=attention), CacheConfig(**{**CACHE, **cache}), SPEC,
                         {"name": "file", "options": {"path": str(tmp_path / name)}})
    payload["kv_reference"] = REFERENCE[attention][1]
    return payload


def _check(reports: list[dict], attention: str = "mha", name: str = "") -> dict:
    first = assert_like_reference(reports, REFERENCE[attention][0], name)
    assert sum(r["storage_errors"] + r["corrupt_objects"] for r in reports) == 0, name
    return first


@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)])
def test_policies_mla_and_cp_rank0_serve_l3(tp, cp, tmp_path):
    runs = {f"{att}/{policy}": _payload(tmp_path, f"{att}-{policy}", att, prefetch_policy=policy)
            for att in ("mha", "mla") for policy in ("best_effort", "wait_complete", "timeout")}
    if cp > 1:
        runs["mha/rank0"] = _payload(tmp_path, "rank0", cp_transfer="rank0")
    results = launch(tp=tp, pp=1, cp=cp, target="tests.helpers.sim_targets:matrix", payload={"runs": runs},
                     timeout_s=60)
    for name in runs:
        first = _check([r[name] for r in results], name.split("/")[0], name)
        if not name.endswith("best_effort"):   # best effort may give up on a fetch: that is its point
            assert first["tokens_from_l3"] > 0, (name, first)


def test_ranks_that_fetched_different_amounts_commit_the_minimum(tmp_path):
    payload = _payload(tmp_path, "odd", prefetch_policy="wait_complete")
    payload["odd_rank"] = 1
    reports = launch(tp=2, pp=1, cp=1, target="tests.helpers.sim_targets:odd_rank_fetches_less", payload=payload,
                     timeout_s=60)
    assert _check(reports)["tokens_from_l3"] > 0


@pytest.mark.parametrize("policy", ["timeout", "wait_complete"])
def test_slow_prefetches_are_terminated_by_their_deadline(policy, tmp_path):
    """The timeout policy's budget, and for wait_complete the cap: a hung backend never holds a
    request for good."""
    payload = _payload(tmp_path, "slow", prefetch_policy=policy, prefetch_timeout_base_s=0.02,
                       prefetch_timeout_per_1k_s=0.0, prefetch_timeout_max_s=0.02)
    payload["delay_s"] = 0.3
    reports = launch(tp=2, pp=1, cp=1, target="tests.helpers.sim_targets:slow_prefetch", payload=payload,
                     timeout_s=60)
    first = _check(reports)
    assert all(r["prefetches_terminated"] > 0 for r in reports)
    assert first["tokens_from_l3"] == 0 and first["transfers"]["prefetch"] > 0


def test_a_slower_later_stage_sets_the_agreed_l3_throughput(tmp_path):
    """Each pipeline stage fetches its own layers, so the slowest stage bounds a prefetch: the
    agreed throughput is the MIN over the world at the step it is offered, not stage 0's."""
    payload = _payload(tmp_path, "slow-stage", prefetch_policy="wait_complete")
    payload["delay_s_per_page"] = 0.004
    reports = launch(tp=1, pp=2, cp=1, target="tests.helpers.sim_targets:slow_stage_records_throughput",
                     payload=payload, timeout_s=90)
    _check(reports)
    stage0, stage1 = reports
    assert stage0["agreed"] == stage1["agreed"]
    assert stage0["agreed"] == [min(a, b) for a, b in zip(stage0["offered"], stage1["offered"])]
    slower = [i for i, (a, b) in enumerate(zip(stage0["offered"], stage1["offered"])) if b < a]
    assert slower, "stage 1 never offered a slower sample: the test proves nothing"
    assert all(stage0["agreed"][i] == stage1["offered"][i] for i in slower)
