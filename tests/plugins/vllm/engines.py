"""Starting real vLLM engines for the tests: each a subprocess running `engine_run.py`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .engine_run import MARK

RUNNER = Path(__file__).with_name("engine_run.py")
START_TIMEOUT_S = 400      # a tp=2 engine starts in about a minute on two cores
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


class EngineFailed(AssertionError):
    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        super().__init__(f"engine exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        self.proc = proc


def run_engine(model: Path, steps: list[dict], extra: dict | None = None, *, env: dict | None = None,
               timeout_s: float = START_TIMEOUT_S, **spec) -> list[dict]:
    """What each `generate` step gave: tokens, top-3 logprobs, num_cached_tokens, params."""
    proc = start_engine(model, steps, extra, env=env, timeout_s=timeout_s, **spec)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise EngineFailed(proc)
    return json.loads(lines[-1][len(MARK):])


def start_engine(model: Path, steps: list[dict], extra: dict | None = None, *, env: dict | None = None,
                 timeout_s: float = START_TIMEOUT_S, **spec) -> subprocess.CompletedProcess:
    payload = json.dumps({"model": str(model), "steps": steps, "extra": extra, **spec})
    return subprocess.run([sys.executable, str(RUNNER), payload], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **(env or {})}, cwd=str(RUNNER.parents[3]))


def gen(prompt: list[int], salt: str | None = None, **kw) -> dict:
    return {"op": "generate", "prompt": prompt, "salt": salt, **kw}


RESET = {"op": "reset"}


def same_output(a: dict, b: dict) -> bool:
    """Greedy tokens and their top-3 logprobs, exactly."""
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
