"""Hybrid models through the connector, in real vLLM with its hybrid KV cache manager on: a
Llama whose layers alternate sliding-window and full attention (two KV cache groups; float32,
so a prefix served and one computed give the same logprobs), and a Qwen3-Next-shaped model
(three gated delta-net layers, each a state group of its own in vLLM's `align` mode, and one
attention layer; bf16, the CPU GDN kernel's only dtype). Each model has a session L3 of its own
(`SharedL3`: a pooled write_through writer and a reader that never computed what it reads).
A prefix served from the host tier, and from L3 in a new process, under every write policy,
gives exactly what vLLM's own prefix cache gives; steps crowding a small host tier give vLLM's
own tokens; a corrupt GDN state object is never served.

vLLM's own outputs: the sliding Llama's from an engine without the connector; the GDN
hybrid's from the reader under a fresh cache salt (nothing in our tiers matches it, so vLLM
computes each request alone as it would without us), which spares a start of its own."""
from __future__ import annotations

import json
import os
import random
import uuid
from dataclasses import dataclass
from typing import Callable
from unittest import mock

import pytest
from hicache_vllm.bench.engine import write_llama

from .conftest import BLOCK, flip_byte, own_prompt, page_files
from .engines import RESET, SharedL3, close_output, gen, gen_many, run_engine, same_output, tiers

WINDOW = 2 * BLOCK      # a sliding layer reads the two pages before a token
HIT = 288
GDN_BLOCK = 160         # vLLM raises the block size until an attention page is as large as a state page
GDN_PROMPT = 700        # the hit: 640 tokens, four blocks, the state at the fourth boundary
CROWD_PAGES = 5         # each crowd prompt: five full pages and four tokens; four a step
HOST_PAGES = 12         # per group: P fits; four crowd prompts (twenty pages) overflow it


@pytest.fixture(scope="session")
def sliding_llama(tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("sliding") / "model", layers=4, hidden=256, heads=4, kv_heads=2,
                       vocab=1024, intermediate=512, logit_scale=4.0)
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def gdn_hybrid(tmp_path_factory):
    """Qwen3-Next's shape, tiny: layers 0-2 gated delta-net (head dim 128, as the CPU kernel
    wants), layer 3 attention with a small MoE (vLLM's Qwen3-Next needs one); seeded random
    weights scaled by 1/sqrt(fan-in), bf16 (the CPU GDN kernel's only dtype)."""
    # transformers sets TORCHINDUCTOR_CACHE_DIR; the environment keys pooled engines: restored, so
    # no engine of the session is started twice
    with mock.patch.dict(os.environ):
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


@dataclass
class Hybrid:
    """A hybrid model under test: its page's tokens, its engine spec, its session L3, and
    `own(steps)`, vLLM's own outputs of steps whose salts nothing in our tiers matches."""

    l3: SharedL3
    page: int
    spec: dict
    own: Callable[[list[dict]], list[dict]]

    def prompt(self, rng: random.Random, tokens: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(tokens)]

    def alone(self, prompts: list[list[int]]) -> list[tuple[dict, dict]]:
        """Each prompt computed alone, then served whole from vLLM's own prefix cache."""
        out = self.own([s for p in prompts for s in (RESET, *[gen(p, uuid.uuid4().hex)] * 2)])
        return list(zip(out[::2], out[1::2]))


@pytest.fixture(scope="session")
def sliding(engines, sliding_llama, tmp_path_factory) -> Hybrid:
    spec = {"dtype": "float32"}
    return Hybrid(SharedL3(engines, sliding_llama, tmp_path_factory.mktemp("sliding-l3")), BLOCK, spec,
                  lambda steps: engines.run(sliding_llama, steps, **spec))


@pytest.fixture(scope="session")
def gdn(engines, gdn_hybrid, tmp_path_factory) -> Hybrid:
    l3 = SharedL3(engines, gdn_hybrid, tmp_path_factory.mktemp("gdn-l3"))
    return Hybrid(l3, GDN_BLOCK, {"block_size": GDN_BLOCK}, lambda steps: l3.read(steps, block_size=GDN_BLOCK))


def test_a_sliding_window_llama_is_served_from_the_host_tier_and_from_l3_in_a_new_process(sliding, salt):
    p = own_prompt(salt)
    ((cold, again),) = sliding.alone([p])
    assert again["cached"] == HIT
    first, from_host = sliding.l3.write([gen(p, salt), RESET, gen(p, salt)], **sliding.spec)
    assert same_output(first, cold)
    assert tiers(from_host) == (HIT, 0) and same_output(from_host, again)
    (from_l3,) = sliding.l3.read([gen(p, salt)], **sliding.spec)
    assert tiers(from_l3) == (0, HIT) and same_output(from_l3, again)


def test_a_gdn_hybrid_is_served_state_and_kv_together_from_the_host_tier_and_from_l3_in_a_new_process(gdn, salt):
    """vLLM's own prefix cache (the second request, in the writer) and our tiers serve the same
    640 tokens (attention KV of four pages and each GDN layer's state at their end) to the same
    batch shapes: tokens and logprobs are equal exactly."""
    p = gdn.prompt(random.Random(salt), GDN_PROMPT)
    first, again, from_host = gdn.l3.write([gen(p, salt), gen(p, salt), RESET, gen(p, salt)], **gdn.spec)
    assert again["cached"] == 4 * GDN_BLOCK and same_output(again, first)
    assert tiers(from_host) == (4 * GDN_BLOCK, 0) and same_output(from_host, again)
    (from_l3,) = gdn.l3.read([gen(p, salt)], **gdn.spec)
    assert tiers(from_l3) == (0, 4 * GDN_BLOCK) and same_output(from_l3, again)


def _shared_prefix(model: Hybrid, salt: str) -> tuple[list[int], int]:
    """The test's own prompt and the prefix vLLM's prefix cache serves of it."""
    if model.page == GDN_BLOCK:
        return model.prompt(random.Random(salt), GDN_PROMPT), 4 * GDN_BLOCK
    return own_prompt(salt), HIT


@pytest.mark.parametrize("kind", ["sliding", "gdn"])
def test_write_through_selective_stores_a_prefix_on_its_second_use(request, kind, salt):
    """P computed, then served from vLLM's own cache, then from the host tier; R once. A new
    process is served P whole from L3 and computes R."""
    model: Hybrid = request.getfixturevalue(kind)
    p, hit = _shared_prefix(model, salt)
    r = model.prompt(random.Random(salt + "r"), len(p))
    (_, p_again), (r_alone, _) = model.alone([p, r])
    run_engine(model.l3.model, [gen(p, salt), gen(p, salt), RESET, gen(p, salt), gen(r, salt)],
               {**model.l3.extra, "write_policy": "write_through_selective"}, **model.spec)
    assert all(page_files(model.l3.path, p, salt, model.page)[:hit // model.page])
    assert not any(page_files(model.l3.path, r, salt, model.page))
    read_p, read_r = model.l3.read([gen(p, salt), gen(r, salt)], **model.spec)
    assert tiers(read_p) == (0, hit) and same_output(read_p, p_again)
    assert tiers(read_r) == (0, 0) and same_output(read_r, r_alone)


@pytest.mark.parametrize("kind", ["sliding", "gdn"])
def test_write_back_over_crowded_steps_gives_vllms_own_output_and_stores_what_leaves_or_stays(request, kind, salt):
    """A fresh writer under write_back with a small host tier: P alone, then eight prompts four
    at a time, twice. Each step's saves overflow the tier in every group, so pages leave it
    through L3, and what it holds at the end is written at the writer's exit. The writer's
    tokens are vLLM's own (its L3 lookups park requests for a step, so its batches differ from
    vLLM's run of the same four prompts: logprobs within 1e-3, as `test_crowded_steps.py`
    explains); a new process is served P whole from L3, and each crowd prompt, one at a time,
    exactly as vLLM serves it (from its own prefix cache where ours served it)."""
    model: Hybrid = request.getfixturevalue(kind)
    p, hit = _shared_prefix(model, salt)
    rng = random.Random(salt + "crowd")
    crowd = [model.prompt(rng, CROWD_PAGES * model.page + 4) for _ in range(8)]
    rounds = [gen_many(crowd[:4], salt), gen_many(crowd[4:], salt)]
    (p_alone, p_again), *alone = model.alone([p, *crowd])
    batched = model.own([gen_many(crowd[:4], uuid.uuid4().hex), gen_many(crowd[4:], uuid.uuid4().hex)])
    extra = {**model.l3.extra, "host_pages": HOST_PAGES, "write_policy": "write_back"}
    p_first, *written = run_engine(model.l3.model, [gen(p, salt), *rounds, RESET, *rounds], extra, **model.spec)
    assert tiers(p_first) == (0, 0) and same_output(p_first, p_alone)
    for n, (first, second) in enumerate(zip(written[:8], written[8:])):
        assert tiers(first) == (0, 0) and close_output(first, batched[n]), (n, tiers(first))
        assert close_output(second, batched[n]), (n, tiers(second))
    assert sum(sum(tiers(out)) for out in written[8:]) >= 4 * model.page     # the second round used our tiers
    assert all(page_files(model.l3.path, p, salt, model.page)[:hit // model.page])     # P left the tier through L3
    read_p, *read = model.l3.read([gen(p, salt), *(gen(c, salt) for c in crowd)], **model.spec)
    assert tiers(read_p) == (0, hit) and same_output(read_p, p_again)
    for n, out in enumerate(read):
        assert same_output(out, alone[n][1] if sum(tiers(out)) else alone[n][0]), (n, tiers(out))
    assert sum(tiers(out)[1] for out in read) >= 4 * model.page                # the new process read L3


def test_a_corrupt_gdn_state_object_is_never_served(gdn, salt):
    """P's attention pages and each GDN layer's state at its one stored boundary in L3, one
    state object corrupt: a new process loads nothing of P (attention KV without its state
    would restart the recurrence from an empty state) and computes it as vLLM alone does."""
    p = gdn.prompt(random.Random(salt), GDN_PROMPT)
    (written,) = gdn.l3.write([gen(p, salt)], **gdn.spec)
    pages = page_files(gdn.l3.path, p, salt, GDN_BLOCK)
    attention = {f.name[64:] for f in pages[0]}         # an object's name: its page hash, then its group's namespace
    states = [f for f in pages[3] if f.name[64:] not in attention]
    assert len(states) == 3
    flip_byte(states[1])
    (read,) = gdn.l3.read([gen(p, salt)], **gdn.spec)
    assert read["cached"] == 0 and same_output(read, written), tiers(read)
