"""Rank targets for the multi-process model tests, and the single-rank reference they match.

The scenario: two prompts prefilled together (one not page-aligned) and decoded together,
then a third prompt that reuses the first prompt's leading pages and runs alone, so with
CP one rank's share of every decode step is empty.
"""
from __future__ import annotations

import asyncio
import random

import torch

from hicache_async.engine import ModelConfig, SeqChunk, TinyModel
from hicache_async.sim.ranks.launcher import RankContext

PAGE_SIZE = 4
NUM_PAGES = 48
STEPS = 16
REUSED = 8  # tokens of prompt "a" that prompt "c" shares: two full pages


def prompts() -> dict[str, list[int]]:
    rng = random.Random(5)
    a = [rng.randrange(256) for _ in range(13)]
    return {"a": a, "b": [rng.randrange(256) for _ in range(8)],
            "c": a[:REUSED] + [rng.randrange(256) for _ in range(6)]}


def new_pool(model: TinyModel) -> torch.Tensor:
    layout = model.kv_layout(PAGE_SIZE)
    return torch.zeros(layout.num_layers, NUM_PAGES, *layout.layer_page_shape, dtype=layout.dtype)


async def generate(model: TinyModel, kv: torch.Tensor, chunks: list[SeqChunk],
                   steps: int = STEPS) -> list[list[int]]:
    """Prefill `chunks` as one batch, then decode them together; `steps` tokens each."""
    out = [[t] for t in await model.forward(chunks, kv)]
    ends = [c.end for c in chunks]
    for _ in range(steps - 1):
        batch = [SeqChunk([o[-1]], e, c.pages) for o, e, c in zip(out, ends, chunks)]
        for o, t in zip(out, await model.forward(batch, kv)):
            o.append(t)
        ends = [e + 1 for e in ends]
    return out


def _pages_for(tokens: int) -> int:
    return -(-(tokens + STEPS) // PAGE_SIZE)


async def scenario(model: TinyModel, kv: torch.Tensor) -> dict[str, list[int]]:
    p = prompts()
    free = list(range(NUM_PAGES))
    random.Random(11).shuffle(free)
    take = lambda n: [free.pop() for _ in range(n)]  # noqa: E731
    pages_a, pages_b = take(_pages_for(13)), take(_pages_for(8))
    a, b = await generate(model, kv, [SeqChunk(p["a"], 0, pages_a), SeqChunk(p["b"], 0, pages_b)])
    pages_c = pages_a[:REUSED // PAGE_SIZE] + take(_pages_for(len(p["c"])) - REUSED // PAGE_SIZE)
    (c,) = await generate(model, kv, [SeqChunk(p["c"][REUSED:], REUSED, pages_c)])
    return {"a": a, "b": b, "c": c}


def reference(cfg: ModelConfig) -> dict[str, list[int]]:
    """Cache-less single rank: each prompt alone, from position 0, on fresh pages."""
    model = TinyModel(cfg)
    out = {}
    for name, tokens in prompts().items():
        chunk = SeqChunk(tokens, 0, list(range(_pages_for(len(tokens)))))
        out[name] = asyncio.run(generate(model, new_pool(model), [chunk]))[0]
    return out


def kv_profile(kv: torch.Tensor) -> list[list[float]]:
    """Sum of |KV| per (local layer, local kv head): compares pools without shipping them."""
    return kv.double().abs().sum(dim=(1, 2, 3, 5)).tolist()


async def run_scenario(ctx: RankContext) -> dict:
    """Target: every attention kind in the payload, run through the scenario on this rank."""
    result = {}
    for attention in ctx.payload["attentions"]:
        model = TinyModel(ModelConfig(attention=attention), ctx.coords, ctx.groups,
                          timeout_s=ctx.timeout_s)
        kv = new_pool(model)
        tokens = await scenario(model, kv)
        result[attention] = {"tokens": tokens, "kv": kv_profile(kv),
                             "layers": [model.layers.start, model.layers.stop],
                             "heads": [model.kv_heads.start, model.kv_heads.stop]}
    return result
