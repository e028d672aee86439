"""Real vLLM engines for the tests, each its own process (`hicache_vllm.bench.engine`):
a fresh one per `run_engine`, or one of the session's engines that live on (`EnginePool`),
which run many tests' batches for one start. (`tests/helpers/starts.py` counts every start.)"""
from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

from hicache_vllm.bench.engine import Engine, EngineFailed, engine_environment
from hicache_vllm.bench.engine import run_engine as _run
from hicache_vllm.bench.engine import start_engine as _start

START_TIMEOUT_S = 400      # a tp=2 engine starts in about a minute on two cores
BATCH_TIMEOUT_S = 240      # a test's batch takes seconds; past this its engine is killed
LIVE = 6                   # pooled engines alive at once (each holds about a GiB)
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
RESET = {"op": "reset"}
ASYNC = {"async_scheduling": True}       # vLLM's GPU default, turned back on for the CPU engine
SCHEDULINGS = pytest.mark.parametrize("scheduling", [{}, ASYNC], ids=["sync", "async"])
SETTLE = {"op": "settle"}

def _spec(model: Path, extra: dict | None, spec: dict) -> dict:
    return {"model": str(model), "extra": extra, "kv_bytes": 64 << 20, **spec}


def run_engine(model: Path, steps: list[dict], extra: dict | None = None, *, env: dict | None = None,
               **spec) -> list[dict]:
    """What each `generate` step of a fresh engine process gave: tokens, top-3 logprobs,
    num_cached_tokens, params."""
    return _run({**_spec(model, extra, spec), "steps": steps}, env, START_TIMEOUT_S)


def start_engine(model: Path, steps: list[dict], extra: dict | None = None, **spec):
    return _start({**_spec(model, extra, spec), "steps": steps}, timeout_s=START_TIMEOUT_S)


POOLS: list[EnginePool] = []     # this process's pools, killed once it runs no more engine tests


class EnginePool:
    """The session's engines that live on, one per settings: the spec without steps, the
    environment the engine starts with (the test process's, with `env` over it: a test that
    set a variable gets an engine that read it), and a process name (a writer and a reader
    that never computed what it reads share settings, not a process). Each batch starts with
    vLLM's prefix cache reset and, with our connector, ends once the backups it issued have
    ended (what an exit would flush), so a test finds the store as a fresh process would have
    left it. Tests keep apart by cache salts or prompts of their own, so none depends on
    another's state or order. An engine that failed is gone: the next batch starts another. At
    most LIVE live; the least recently used is killed first (see `close`). One rank only
    (`settle` needs the engine in its process). Each start is said on stderr with its
    settings, its environment as a digest."""

    PER_TEST = ("PYTEST_CURRENT_TEST",)     # pytest rewrites it around each test; no engine reads it

    def __init__(self) -> None:
        self._engines: OrderedDict[str, Engine] = OrderedDict()
        self.starts = 0
        POOLS.append(self)

    def run(self, model: Path, steps: list[dict], extra: dict | None = None, *, env: dict | None = None,
            process: str = "", **spec) -> list[dict]:
        settings = _spec(model, extra, spec)
        environment = {k: v for k, v in engine_environment(settings, env).items() if k not in self.PER_TEST}
        digest = hashlib.sha256(json.dumps(environment, sort_keys=True).encode()).hexdigest()[:12]
        key = json.dumps({**settings, "env": env or {}, "environment": digest, "process": process}, sort_keys=True)
        engine = self._engine(key, settings, env)
        settle = [SETTLE] if extra is not None and settings.get("connector", "HiCacheConnector") else []
        try:
            return engine.run([RESET, *steps, *settle], BATCH_TIMEOUT_S)
        except EngineFailed:
            del self._engines[key]
            raise

    def _engine(self, key: str, settings: dict, env: dict | None) -> Engine:
        engine = self._engines.pop(key, None)
        if engine is None or not engine.alive:
            while len(self._engines) >= LIVE:
                self._engines.popitem(last=False)[1].kill()
            self.starts += 1
            print(f"pooled vLLM engine #{self.starts}: {key}", file=sys.stderr)
            engine = Engine(settings, env, START_TIMEOUT_S)
        self._engines[key] = engine
        return engine

    def close(self) -> None:
        """Every engine killed: each batch waited for its backups to end, so nothing is left to
        flush, and a graceful exit costs seconds an engine at the end of the session."""
        engines, self._engines = list(self._engines.values()), OrderedDict()
        for engine in engines:
            engine.kill()


class SharedL3:
    """A file L3 for the session and three pooled processes over it: a writer, a reader that
    never computed what it reads, and a second such reader (for what the first one rewrote),
    which loads the connector by its entry point name. A test keeps to its own cache salt."""

    def __init__(self, pool: EnginePool, model: Path, path: Path) -> None:
        self.pool, self.model, self.path = pool, model, path
        # L3's correctness, not the decision to read it (`test_l3_reads.py`): every run is read
        self.extra = {"storage": "file", "storage_path": str(path), "l3_reads": "always"}

    def write(self, steps: list[dict], **spec) -> list[dict]:
        return self.pool.run(self.model, steps, self.extra, process="writer", **spec)

    def read(self, steps: list[dict], **spec) -> list[dict]:
        return self.pool.run(self.model, steps, self.extra, process="reader", **spec)

    def read_again(self, steps: list[dict], **spec) -> list[dict]:
        return self.pool.run(self.model, steps, self.extra, by_name=True, process="second reader", **spec)


def gen(prompt: list[int], salt: str | None = None) -> dict:
    """Eight greedy tokens with their top-3 logprobs."""
    return {"op": "generate", "prompt": prompt, "salt": salt, "max_tokens": 8, "logprobs": 3}


def gen_many(prompts: list[list[int]], salt: str | None = None) -> dict:
    """The prompts sent together, one `generate` each, as `gen`."""
    return {**gen([], salt), "op": "generate_many", "prompts": prompts}


def same_output(a: dict, b: dict) -> bool:
    """Greedy tokens and their top-3 logprobs, exactly."""
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def close_output(a: dict, b: dict, tol: float = 1e-3) -> bool:
    """The same greedy tokens, and top-3 logprobs within `tol`: where the batches that computed
    the KV differ in shape, which alone moves float32 logprobs by about 1e-5 (a wrong page of KV
    changes the tokens)."""
    return a["tokens"] == b["tokens"] and all(
        d.keys() == e.keys() and all(abs(d[k] - e[k]) <= tol for k in d) for d, e in zip(a["logprobs"], b["logprobs"]))


def tiers(result: dict) -> tuple[int, int]:
    """(host-tier tokens, L3 tokens) of a `generate` step's prefix, from its kv_transfer_params."""
    ours = result["params"]["hicache"]
    return ours["host_tokens"], ours["l3_tokens"]
