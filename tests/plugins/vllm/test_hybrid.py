"""Hybrid models through the connector, in real vLLM with its hybrid KV cache manager on: a
Llama whose layers alternate sliding-window and full attention (two KV cache groups). A
prefix served from the host tier, and from L3 in a new process, gives exactly what vLLM's own
prefix cache gives; a model whose group kind we do not cache is refused at start."""
from __future__ import annotations

import json

import pytest
from hicache_vllm.bench.engine import write_llama

from .conftest import BLOCK, own_prompt
from .engines import RESET, gen, same_output, tiers

WINDOW = 2 * BLOCK      # a sliding layer reads the two pages before a token
HIT = 288


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
