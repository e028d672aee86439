"""HiCacheConnector inside real vLLM: the host tier, L3 across processes, tenants, by name."""
from __future__ import annotations

from .conftest import BLOCK, SHARED_PAGES, own_prompt
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


def test_l3_serves_a_new_engine_process_over_the_same_path(prompts, cold, l3, salt):
    """Written by one process, read by another that loads the connector by its entry point name."""
    l3.write([gen(prompts["p"], salt)])
    p, q = l3.read_again([gen(prompts["p"], salt), RESET, gen(prompts["q"], salt)])
    assert p["cached"] == 288 and tiers(p) == (0, 288)
    assert same_output(p, cold["p_prefix_cache"])
    assert q["cached"] == SHARED_PAGES * BLOCK and same_output(q, cold["q"])


def test_tenants_share_nothing_across_salts_in_either_tier(reference, l3, salt):
    """A prompt of the test's own under three tenants (salts of its own) and none."""
    p = own_prompt(salt)
    cold_p, cold_p_prefix_cache = reference(p)
    alice, bob, carol = (f"{salt}-{name}" for name in ("alice", "bob", "carol"))
    other, own = l3.write([gen(p, alice), RESET, gen(p, bob), RESET, gen(p, alice)])[1:]
    carol_out, alice_out, none = l3.read([gen(p, carol), gen(p, alice), gen(p)])
    assert other["cached"] == 0 and same_output(other, cold_p)
    assert own["cached"] == 288 and own["params"]["hicache"]["host_tokens"] == 288
    assert carol_out["cached"] == 0 and same_output(carol_out, cold_p)
    assert none["cached"] == 0 and same_output(none, cold_p)
    assert alice_out["params"]["hicache"]["l3_tokens"] == 288 and same_output(alice_out, cold_p_prefix_cache)
