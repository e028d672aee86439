"""Real vLLM engines for the tests: each its own process (`hicache_async.app.bench.vllm_engine`)."""
from __future__ import annotations

from pathlib import Path

from hicache_async.app.bench.vllm_engine import run_engine as _run
from hicache_async.app.bench.vllm_engine import start_engine as _start

START_TIMEOUT_S = 400      # a tp=2 engine starts in about a minute on two cores
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
RESET = {"op": "reset"}


def run_engine(model: Path, steps: list[dict], extra: dict | None = None, *, env: dict | None = None,
               **spec) -> list[dict]:
    """What each `generate` step gave: tokens, top-3 logprobs, num_cached_tokens, params."""
    return _run({"model": str(model), "steps": steps, "extra": extra, "kv_bytes": 64 << 20, **spec}, env,
                START_TIMEOUT_S)


def start_engine(model: Path, steps: list[dict], extra: dict | None = None, **spec):
    return _start({"model": str(model), "steps": steps, "extra": extra, "kv_bytes": 64 << 20, **spec},
                  timeout_s=START_TIMEOUT_S)


def gen(prompt: list[int], salt: str | None = None) -> dict:
    """Eight greedy tokens with their top-3 logprobs."""
    return {"op": "generate", "prompt": prompt, "salt": salt, "max_tokens": 8, "logprobs": 3}


def same_output(a: dict, b: dict) -> bool:
    """Greedy tokens and their top-3 logprobs, exactly."""
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def tiers(result: dict) -> tuple[int, int]:
    """(host-tier tokens, L3 tokens) of a `generate` step's prefix, from its kv_transfer_params."""
    ours = result["params"]["hicache"]
    return ours["host_tokens"], ours["l3_tokens"]
