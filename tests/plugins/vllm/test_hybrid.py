"""Hybrid models through the connector, in real vLLM with its hybrid KV cache manager on: a
Llama whose layers alternate sliding-window and full attention (two KV cache groups), and a
Qwen3-Next-shaped model (three gated delta-net layers, each a state group of its own in
vLLM's `align` mode, and one attention layer). A prefix served from the host tier, and from
L3 in a new process, gives exactly what vLLM's own prefix cache gives."""
from __future__ import annotations

import json
import random

import pytest
from hicache_vllm.bench.engine import write_llama

from .conftest import BLOCK, own_prompt
from .engines import RESET, gen, same_output, tiers

WINDOW = 2 * BLOCK      # a sliding layer reads the two pages before a token
HIT = 288
GDN_BLOCK = 160         # vLLM raises the block size until an attention page is as large as a state page
GDN_PROMPT = 700        # the hit: 640 tokens, four blocks, the state at the fourth boundary


@pytest.fixture(scope="session")
def sliding_llama(tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("sliding") / "model", layers=4, hidden=256, heads=4, kv_heads=2,
                       vocab=1024, intermediate=512, logit_scale=4.0)
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_sliding_window_llama_is_served_from_the_host_tier_and_from_l3_in_a_new_process(
        engines, sliding_llama, salt, tmp_path):
    p = own_prompt(salt)
    cold, again = engines.run(sliding_llama, [gen(p), gen(p)])
    assert again["cached"] == HIT
    extra = {"storage": "file", "storage_path": str(tmp_path / "l3"), "write_policy": "write_through"}
    first, from_host = engines.run(sliding_llama, [gen(p, salt), RESET, gen(p, salt)], extra, process="writer")
    assert same_output(first, cold)
    assert tiers(from_host) == (HIT, 0) and same_output(from_host, again)
    (from_l3,) = engines.run(sliding_llama, [gen(p, salt)], extra, process="reader")
    assert tiers(from_l3) == (0, HIT) and same_output(from_l3, again)


@pytest.fixture(scope="session")
def gdn_hybrid(tmp_path_factory):
    """Qwen3-Next's shape, tiny: layers 0-2 gated delta-net (head dim 128, as the CPU kernel
    wants), layer 3 attention with a small MoE (vLLM's Qwen3-Next needs one); seeded random
    weights scaled by 1/sqrt(fan-in), bf16 (the CPU GDN kernel's only dtype)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=1, linear_num_value_heads=2, mlp_only_layers=[0, 1, 2], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for weight in (w for w in model.parameters() if w.dim() >= 2):
            weight.copy_(torch.randn_like(weight) / weight.shape[-1] ** 0.5)
    path = tmp_path_factory.mktemp("gdn") / "model"
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def test_a_gdn_hybrid_is_served_state_and_kv_together_from_the_host_tier_and_from_l3_in_a_new_process(
        engines, gdn_hybrid, salt, tmp_path):
    """vLLM's own prefix cache (the second request, in the writer) and our tiers serve the same
    640 tokens (attention KV of four pages and each GDN layer's state at their end) to the same
    batch shapes: tokens and logprobs are equal exactly."""
    rng = random.Random(salt)
    p = [rng.randrange(3, 1000) for _ in range(GDN_PROMPT)]
    extra = {"storage": "file", "storage_path": str(tmp_path / "l3"), "write_policy": "write_through"}
    first, again, from_host = engines.run(gdn_hybrid, [gen(p, salt), gen(p, salt), RESET, gen(p, salt)], extra,
                                          process="writer", block_size=GDN_BLOCK)
    assert again["cached"] == 4 * GDN_BLOCK and same_output(again, first)
    assert tiers(from_host) == (4 * GDN_BLOCK, 0) and same_output(from_host, again)
    (from_l3,) = engines.run(gdn_hybrid, [gen(p, salt)], extra, process="reader", block_size=GDN_BLOCK)
    assert tiers(from_l3) == (0, 4 * GDN_BLOCK) and same_output(from_l3, again)
