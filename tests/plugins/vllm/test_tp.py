"""Unified keys in real vLLM: what a tp=1 engine stored serves a tp=2 engine (each of its two
worker processes reads its own heads of the same objects)."""
from __future__ import annotations

import uuid

import pytest

from .engines import RESET, TP2_ENV, gen, run_engine, tiers


@pytest.mark.timeout(900)
def test_a_tp1_writer_serves_a_tp2_reader_with_unified_keys(llama, prompts, cold, tmp_path):
    extra = {"storage": "file", "storage_path": str(tmp_path / "l3"), "key_scheme": "unified"}
    run_engine(llama, [gen(prompts["p"])], extra)
    # the reader then computes P under a fresh cache salt, which nothing in our tiers or vLLM's
    # matches: tp=2 alone, without a second tp=2 engine start
    read, alone = run_engine(llama, [gen(prompts["p"]), RESET, gen(prompts["p"], uuid.uuid4().hex)], extra,
                             tp=2, env=TP2_ENV)
    assert read["cached"] == 288 and tiers(read) == (0, 288)
    assert alone["cached"] == 0 and tiers(alone) == (0, 0)
    # tp=2 sums its partial products in another order, so its KV (and logprobs) differ from tp=1's
    # in the last bits; the greedy tokens do not, with the cache or without it.
    assert read["tokens"] == alone["tokens"] == cold["p"]["tokens"]
