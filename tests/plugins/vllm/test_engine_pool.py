"""The pooled engines: one process runs batch after batch; a batch past its bound kills its
engine and fails in one error, and the next batch on those settings gets a new process."""
from __future__ import annotations

import pytest

from hicache_async.app.bench.vllm_engine import EngineFailed

from . import engines
from .engines import RESET, EnginePool, gen, same_output


def test_one_process_runs_many_batches_and_one_past_its_bound_is_replaced(llama, prompts, cold, monkeypatch):
    pool = EnginePool()
    try:
        for _ in range(2):
            (out,) = pool.run(llama, [gen(prompts["p"])], process="bounded")
            assert same_output(out, cold["p"])          # the prefix cache reset before each batch
        assert pool.starts == 1
        monkeypatch.setattr(engines, "BATCH_TIMEOUT_S", 1)
        with pytest.raises(EngineFailed, match="no answer in 1 s for a batch; killed"):
            pool.run(llama, [RESET, gen(prompts["p"])] * 100, process="bounded")     # seconds of prefills
        monkeypatch.undo()
        (out,) = pool.run(llama, [gen(prompts["p"])], process="bounded")
        assert same_output(out, cold["p"]) and pool.starts == 2
    finally:
        pool.close()
