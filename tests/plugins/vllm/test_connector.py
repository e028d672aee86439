"""HiCacheConnector inside real vLLM: the host tier, L3 across processes, tenants, by name."""
from __future__ import annotations

from .conftest import BLOCK, SHARED_PAGES
from .engines import RESET, gen, run_engine, same_output, tiers


def test_host_tier_serves_a_reset_prefix_exactly_as_vllms_prefix_cache(llama, prompts, cold):
    p, q = prompts["p"], prompts["q"]
    first, from_host, shared = run_engine(llama, [gen(p), RESET, gen(p), RESET, gen(q)], {"storage": "none"})
    assert first["cached"] == 0 and same_output(first, cold["p"])
    assert from_host["cached"] == 288
    assert tiers(from_host) == (288, 0)
    assert same_output(from_host, cold["p_prefix_cache"])
    assert shared["cached"] == SHARED_PAGES * BLOCK     # a new prompt's shared prefix, from the host tier
    assert same_output(shared, cold["q"])


def test_l3_serves_a_new_engine_process_over_the_same_path(llama, prompts, cold, tmp_path):
    extra = {"storage": "file", "storage_path": str(tmp_path / "l3")}
    run_engine(llama, [gen(prompts["p"])], extra)
    p, q = run_engine(llama, [gen(prompts["p"]), RESET, gen(prompts["q"])], extra, by_name=True)
    assert p["cached"] == 288 and tiers(p) == (0, 288)
    assert same_output(p, cold["p_prefix_cache"])
    assert q["cached"] == SHARED_PAGES * BLOCK and same_output(q, cold["q"])


def test_tenants_share_nothing_across_salts_in_either_tier(llama, prompts, cold, tmp_path):
    p = prompts["p"]
    extra = {"storage": "file", "storage_path": str(tmp_path / "l3")}
    other, own = run_engine(llama, [gen(p, "alice"), RESET, gen(p, "bob"), RESET, gen(p, "alice")], extra)[1:]
    assert other["cached"] == 0 and same_output(other, cold["p"])
    assert own["cached"] == 288 and own["params"]["hicache"]["host_tokens"] == 288
    bob, alice, none = run_engine(llama, [gen(p, "carol"), gen(p, "alice"), gen(p)], extra)
    assert bob["cached"] == 0 and same_output(bob, cold["p"])
    assert none["cached"] == 0 and same_output(none, cold["p"])
    assert alice["params"]["hicache"]["l3_tokens"] == 288 and same_output(alice, cold["p_prefix_cache"])
