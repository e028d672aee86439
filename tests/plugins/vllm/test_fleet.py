"""`bench --only vllm-fleet`, reduced: two real vLLM OpenAI servers (CPU build) per arm over one
Mooncake L3, the quick stream (15 requests, 5 sessions of 3 turns, 2 in flight). Outputs and
token counts, not times: times on a shared 2-core machine say nothing."""
import pytest

pytest.importorskip("hicache_vllm")
pytest.importorskip("mooncake")
pytest.importorskip("dynamo.llm")

from hicache_vllm.bench.fleet_figures import ARMS, QUICK, _figures, run_arms  # noqa: E402
from hicache_vllm.bench.fleet_stream import stream  # noqa: E402


@pytest.fixture(scope="module")
def arms() -> dict:
    return run_arms(QUICK, ARMS, l3_reads="always")     # L3's reach, not the decision (`test_l3_reads.py`)


def test_every_arm_answers_every_request_as_vllm_alone_does(arms):
    assert list(arms) == list(ARMS)
    turns = stream(QUICK)
    for arm, r in arms.items():
        assert r["outputs_equal_vllm"], arm
        assert sum(r["requests_per_server"]) == len(turns), (arm, r["requests_per_server"])
        # vLLM counts every prompt token once, whoever served it
        assert r["prompt_tokens"] == sum(len(t.prompt) for t in turns), arm
        assert r["tokens"]["computed"] >= 0 and sum(r["tokens"].values()) == r["prompt_tokens"], (arm, r["tokens"])


def test_round_robin_splits_evenly_and_the_router_within_its_load_bound(arms):
    for arm in ("vllm", "host_only", "shared_l3"):
        assert arms[arm]["requests_per_server"] == [8, 7], arm
    assert arms["ideal"]["requests_per_server"] == [15]
    routed = arms["routed"]["requests_per_server"]
    assert min(routed) > 0 and max(routed) <= 1.5 * min(routed) + 1, routed


def test_tiers_serve_what_each_arm_has(arms):
    tokens = {arm: r["tokens"] for arm, r in arms.items()}
    assert tokens["vllm"]["host"] == tokens["vllm"]["l3"] == 0
    assert tokens["host_only"]["l3"] == 0
    # round-robin moves every session to the other server each turn: only a shared L3 has its pages there
    assert tokens["shared_l3"]["l3"] > 0
    assert tokens["shared_l3"]["computed"] < tokens["host_only"]["computed"] <= tokens["vllm"]["computed"]
    # the quick stream fits the two devices, so where the router sends a turn moves few tokens
    # (the full bench measures that); what it must keep is the shared L3's reach
    assert tokens["routed"]["computed"] < tokens["host_only"]["computed"]
    assert tokens["ideal"]["computed"] <= tokens["shared_l3"]["computed"]


def test_the_figures_carry_each_arms_object_and_the_goals(arms):
    rows = {r["name"]: r for r in _figures(arms)}
    for arm in ARMS:
        obj = rows[f"vllm_fleet_{arm}_mean_ttft_s"]["arm"]
        assert obj["arm"] == arm and set(obj["tokens"]) == {"device", "host", "l3", "computed"}
        assert {"mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "duration_s", "requests_per_server",
                "outputs_equal_vllm"} <= set(obj)
        if arm != "vllm":       # our servers time every first token, under the tier that served most of it
            assert sum(t["requests"] for t in obj["by_tier"].values()) == len(stream(QUICK)), (arm, obj["by_tier"])
    for goal in ("ideal_vs_shared_l3_hit_rate", "shared_l3_vs_host_only_mean_ttft", "routed_vs_shared_l3_mean_ttft",
                 "routed_busiest_vs_idlest"):
        row = rows[f"vllm_fleet_{goal}"]
        assert row["goal_met"] == (row["ratio"] <= row["goal_max_ratio"]), row
