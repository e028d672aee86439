"""The pooled engines: one process runs batch after batch, each from a reset prefix cache; a
batch past its bound kills its engine and fails in one error, and the next batch on those
settings gets a new process; an engine serves only the environment it started with."""
from __future__ import annotations

import os

import pytest

from hicache_vllm.bench.engine import EngineFailed, engine_environment

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


class _Unstarted:
    """An engine as the pool sees it, with no process behind it: the environment it would have
    started with (the pool's keying, not vLLM, is what this file's second test is about)."""

    def __init__(self, settings: dict, env: dict | None, start_timeout_s: float) -> None:
        self.environment, self.alive = engine_environment(settings, env), True

    def run(self, steps: list[dict], timeout_s: float) -> list[dict]:
        return []

    def kill(self) -> None:
        self.alive = False


def test_an_engine_serves_only_the_environment_it_started_with(llama, monkeypatch):
    """A variable a test sets reaches an engine started under it, not one another test started;
    what pytest rewrites around each test keys nothing (every test would start its own)."""
    monkeypatch.setattr(engines, "Engine", _Unstarted)
    pool = EnginePool()
    try:
        pool.run(llama, [], process="environment")
        with monkeypatch.context() as m:
            m.setenv("OTEL_SERVICE_NAME", "pooled-engine-test")
            pool.run(llama, [], process="environment")
        assert pool.starts == 2
        started = [e.environment.get("OTEL_SERVICE_NAME") for e in pool._engines.values()]
        assert started == [os.environ.get("OTEL_SERVICE_NAME"), "pooled-engine-test"]
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
        pool.run(llama, [], process="environment")
        assert pool.starts == 2
    finally:
        pool.close()
