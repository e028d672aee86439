"""The tiny reference model: paging, chunking, layer-wise loads and TP/PP/CP splits must all
give the greedy tokens of a cache-less single-rank run."""
from __future__ import annotations

import asyncio
import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_async.engine import ModelConfig, SeqChunk, TinyModel
from hicache_async.engine.tiny.attention import read_kv
from hicache_async.engine.tiny.weights import layer_weights
from hicache_async.errors import UsageError
from hicache_async.sim.ranks.launcher import launch
from hicache_async.topology import RankCoords
from tests.helpers import model_targets as targets

PAGE = 4
ATTENTIONS = ("mha", "mla")
MODELS = {a: TinyModel(ModelConfig(attention=a)) for a in ATTENTIONS}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _pool(model: TinyModel, pages: int = 32) -> torch.Tensor:
    layout = model.kv_layout(PAGE)
    return torch.zeros(layout.num_layers, pages, *layout.layer_page_shape, dtype=layout.dtype)


async def _run(model, prompt, cuts, pages, steps=20, kv=None, layer_ready=None, start=0):
    """Prefill `prompt` from `start` (KV before it already in `kv`) in pieces ending at
    `cuts`, then decode; returns (tokens, kv)."""
    kv = _pool(model) if kv is None else kv
    for i, end in enumerate(cuts):
        ready = layer_ready if i == 0 else None
        (tok,) = await model.forward([SeqChunk(prompt[start:end], start, pages)], kv, ready)
        start = end
    out = [tok]
    for _ in range(steps - 1):
        (tok,) = await model.forward([SeqChunk([out[-1]], start, pages)], kv)
        start += 1
        out.append(tok)
    return out, kv


def _shuffled_pages(seed: int, n: int = 16) -> list[int]:
    pages = list(range(32))
    random.Random(seed).shuffle(pages)
    return pages[:n]


@pytest.mark.parametrize("attention", ATTENTIONS)
async def test_chunked_paged_prefill_matches_one_shot(attention):
    model, prompt = MODELS[attention], _prompt(1, 23)
    whole, kv_whole = await _run(model, prompt, [23], list(range(16)))
    pages = _shuffled_pages(2)
    halves, kv_halves = await _run(model, prompt, [9, 23], pages)
    singles, _ = await _run(model, prompt, list(range(1, 24)), _shuffled_pages(3))
    assert whole == halves == singles
    assert len(set(whole)) > 1
    for layer in range(kv_whole.shape[0]):
        a = read_kv(kv_whole[layer], torch.arange(16), 23)
        b = read_kv(kv_halves[layer], torch.tensor(pages), 23)
        assert torch.equal(a, b)


@pytest.mark.parametrize("attention", ATTENTIONS)
async def test_logits_are_not_degenerate(attention):
    model, gaps, tokens = MODELS[attention], [], []
    for seed in range(6):
        chunk = SeqChunk(_prompt(seed, 12), 0, list(range(3)))
        logits = await model.last_logits([chunk], _pool(model))
        top = logits.topk(2).values[0]
        gaps.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
    assert sum(gaps) / len(gaps) > 0.05
    assert len(set(tokens)) >= 4


@pytest.mark.parametrize("attention", ATTENTIONS)
async def test_corrupted_prefix_kv_changes_tokens(attention):
    """The equality proofs mean something only if wrong cached KV shows in the tokens."""
    model = MODELS[attention]
    changed = 0
    for seed in range(3):
        prompt = _prompt(10 + seed, 16)
        clean, _ = await _run(model, prompt, [16], list(range(8)), steps=8)
        kv = _pool(model)
        await model.forward([SeqChunk(prompt[:8], 0, list(range(8)))], kv)
        kv[:, 0] += 0.5 * torch.randn(kv[:, 0].shape, generator=torch.Generator().manual_seed(seed))
        dirty, _ = await _run(model, prompt, [16], list(range(8)), steps=8, kv=kv, start=8)
        changed += clean != dirty
    assert changed >= 2


@pytest.mark.parametrize("attention", ATTENTIONS)
async def test_layer_ready_gates_each_layer_read(attention):
    """A prefix loaded layer by layer while the forward runs gives the reference tokens."""
    model, prompt, pages = MODELS[attention], _prompt(4, 21), _shuffled_pages(5)
    expected, donor = await _run(model, prompt, [21], pages)
    kv, calls = _pool(model), []

    async def load_layer(i: int) -> None:
        await asyncio.sleep(0)
        kv[i, pages[:3]] = donor[i, pages[:3]]
        calls.append(i)

    got, _ = await _run(model, prompt, [21], pages, kv=kv, layer_ready=load_layer, start=12)
    assert calls == list(range(model.cfg.layers))
    assert got == expected


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, 18), max_size=3, unique=True), seed=st.integers(0, 31))
def test_any_chunking_gives_same_token_and_kv(cuts, seed):
    model, prompt = MODELS["mha"], _prompt(seed, 19)
    pages = _shuffled_pages(seed, 5)
    ref_tok, ref_kv = asyncio.run(_run(model, prompt, [19], pages, steps=1))
    tok, kv = asyncio.run(_run(model, prompt, sorted(cuts) + [19], pages, steps=1))
    assert tok == ref_tok
    assert torch.equal(kv, ref_kv)


def test_weights_split_like_one_rank():
    cfg = ModelConfig()
    whole = layer_weights(cfg, 2, range(4), range(2))
    halves = [layer_weights(cfg, 2, range(2 * r, 2 * r + 2), range(r, r + 1)) for r in range(2)]
    assert torch.equal(torch.cat([h.wq for h in halves], 1), whole.wq)
    assert torch.equal(torch.cat([h.wk for h in halves], 1), whole.wk)
    assert torch.equal(torch.cat([h.wo for h in halves], 0), whole.wo)
    stage = TinyModel(cfg, RankCoords(pp_rank=1, pp_size=2))
    assert stage.layers == range(2, 4) and torch.equal(stage.weights[0].w_up, whole.w_up)


def test_kv_layout_names_rank_slice():
    mha = TinyModel(ModelConfig(), RankCoords(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2))
    layout = mha.kv_layout(8)
    assert (layout.first_layer, layout.num_layers) == (2, 2)
    assert (layout.first_head, layout.kv_heads) == (1, 1)
    assert (layout.total_layers, layout.total_kv_heads, layout.planes) == (4, 2, 2)
    mla = TinyModel(ModelConfig(attention="mla"), RankCoords(tp_rank=1, tp_size=2)).kv_layout(8)
    assert (mla.kv_heads, mla.head_dim, mla.planes, mla.first_head) == (1, 40, 1, 0)
    other_seed = TinyModel(ModelConfig(attention="mla", seed=1)).kv_layout(8)
    assert mla.namespace() != other_seed.namespace()


async def test_bad_inputs_raise_one_line_usage_errors():
    model = MODELS["mha"]
    with pytest.raises(UsageError, match="2 pages of 4 cannot hold 9"):
        await model.forward([SeqChunk(list(range(9)), 0, [0, 1])], _pool(model))
    with pytest.raises(UsageError, match="token id 999"):
        await model.forward([SeqChunk([999], 0, [0])], _pool(model))
    with pytest.raises(UsageError, match="kv pool shape"):
        await model.forward([SeqChunk([1], 0, [0])], torch.zeros(4, 2, 2, 4, 1, 16))
    with pytest.raises(UsageError, match="--tp 3 neither divides the model's 2 kv heads"):
        TinyModel(ModelConfig(), RankCoords(tp_size=3))
    with pytest.raises(UsageError, match="--tp 8 does not divide the model's 4 query heads"):
        TinyModel(ModelConfig(), RankCoords(tp_size=8))


# -- multi-rank: real processes joined by gloo ------------------------------------------------

@functools.cache
def _single_rank(attention: str) -> tuple[dict, torch.Tensor]:
    """The multi-rank scenario (batched, prefix reuse) on one rank: tokens and KV profile."""
    kv = targets.new_pool(MODELS[attention])
    tokens = asyncio.run(targets.scenario(MODELS[attention], kv))
    return tokens, torch.tensor(targets.kv_profile(kv), dtype=torch.float64)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_batched_prefix_reuse_matches_reference(attention):
    reference = targets.reference(ModelConfig(attention=attention))
    assert _single_rank(attention)[0] == reference
    assert len(set(reference["a"])) > 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp,pp,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2)])
def test_multi_rank_tokens_match_single_rank(tp, pp, cp):
    ranks = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.model_targets:run_scenario",
                   payload={"attentions": list(ATTENTIONS)}, timeout_s=60)
    for attention in ATTENTIONS:
        expected = targets.reference(ModelConfig(attention=attention))
        full_kv = _single_rank(attention)[1]
        for result in ranks:
            mine = result[attention]
            assert mine["tokens"] == expected
            (l0, l1), (h0, h1) = mine["layers"], mine["heads"]
            torch.testing.assert_close(torch.tensor(mine["kv"], dtype=torch.float64),
                                       full_kv[l0:l1, h0:h1], rtol=1e-6, atol=1e-6)
