"""The pooled engines: one process runs batch after batch, each from a reset prefix cache; a
batch past its bound kills its engine and fails in one error, and the next batch on those
settings gets a new process; an engine serves only the environment it started with."""
from __future__ import annotations

import pytest

from hicache_vllm.bench.engine import EngineFailed

from . import engines
from .engines import RESET, EnginePool, gen, same_output


def test_one_process_runs_many_batches_and_one_past_its_bound_is_replaced(llama, prompts, cold, monkeypatch):
    hit = cold["p_prefix_cache"]["cached"]      # what vLLM's prefix cache serves of P once it holds P
    pool = EnginePool()
    try:
        for _ in range(2):
            first, again = pool.run(llama, [gen(prompts["p"]), gen(prompts["p"])], process="bounded")
            assert (first["cached"], again["cached"]) == (0, hit)     # the batch before left P cached
            assert same_output(first, cold["p"])
        assert pool.starts == 1
        monkeypatch.setattr(engines, "BATCH_TIMEOUT_S", 1)
        with pytest.raises(EngineFailed, match="no answer in 1 s for a batch; killed"):
            pool.run(llama, [RESET, gen(prompts["p"])] * 100, process="bounded")     # seconds of prefills
        monkeypatch.undo()
        (out,) = pool.run(llama, [gen(prompts["p"])], process="bounded")
        assert same_output(out, cold["p"]) and out["cached"] == 0 and pool.starts == 2
    finally:
        pool.close()


def test_an_engine_serves_only_the_environment_it_started_with(llama, monkeypatch):
    """A variable a test sets reaches an engine started under it, not one another test started;
    what pytest rewrites around each test keys nothing (every test would start its own)."""
    pool = EnginePool()
    try:
        pool.run(llama, [], process="environment")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "pooled-engine-test")
        pool.run(llama, [], process="environment")
        assert pool.starts == 2
        monkeypatch.undo()
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
        pool.run(llama, [], process="environment")
        assert pool.starts == 2
    finally:
        pool.close()
