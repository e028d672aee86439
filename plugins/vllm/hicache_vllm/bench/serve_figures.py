"""vLLM serving figures (`bench --only vllm-serve`): TTFT as vLLM's own `bench serve` client sees
it, one request at a time, from vLLM's OpenAI server started through its serve entry point.

The prompts (`--dataset-name prefix_repetition`, shuffled, seeded) share 6 prefixes of 1,500
tokens on a seeded 8-layer Llama with 8 KiB of KV a token: the prefixes are about 3x the 24 MiB
of device KV, so vLLM's own prefix cache has lost most of them by their next use. One server a
run, each beside vLLM alone in the same bench:
- `vllm`: no connector (the baseline);
- `host`: our host tier holding every page;
- `small_host`, `small_host_file`, `small_host_mooncake`: a host tier of a quarter of the
  prefixes, alone, over a file store, and over a real `mooncake_master` on free ports.
Each gives the client's mean, median and p99 TTFT and its duration, the median TTFT of each
prefix's first use (a prompt no tier has seen: what a miss costs), and the tokens our connector
served (the server's `vllm:external_prefix_cache_hits`; the client's ready check, a copy of its
first prompt, is counted there too). Every server has the same cores and thread count
(`pinned_threads`): vLLM alone must not time a thread count other than ours.

Start-up is most of the time (20 s of imports a server on 2 cores), so every server starts at
once and one client process runs against each in turn once all serve; an idle server takes
about 2% of a core. The worker runs in the engine's process (uni executor): a process of its own
would add its start-up and nothing these figures measure.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hicache_async.app.bench.figure import figure, skipped
from hicache_async.errors import HiCacheError
from hicache_async.ports import free_port
from hicache_async.sim.ranks.launcher import die_with_parent

from . import launch, require_vllm
from .engine import THREADS_BIND, pinned_threads
from ..first_tokens import TIERS

LLAMA = {"layers": 8, "hidden": 256, "heads": 4, "intermediate": 512, "vocab": 2048}   # 8 KiB of bf16 KV a token
BLOCK, DEVICE_KV = 32, 24 << 20                         # 96 blocks: 3,072 tokens
PREFIX, SUFFIX, PREFIXES = 1_500, 100, 6                # 9,000 prefix tokens: about 3x the device KV
LARGE_HOST = 384                # every distinct page: 6 x 46 of prefix, 24 x 4 with a suffix
SMALL_HOST = 72                 # a quarter of the prefixes' 281 pages
_L3 = {"host_pages": SMALL_HOST, "storage_optional": False}     # an L3 that is not there fails the start
RUNS = {"vllm": None, "host": {"storage": "none", "host_pages": LARGE_HOST},
        "small_host": {"storage": "none", "host_pages": SMALL_HOST},
        "small_host_file": {"storage": "file", **_L3}, "small_host_mooncake": {"storage": "mooncake", **_L3}}
MUST_HIT = ("host", "small_host_file", "small_host_mooncake")
STATS = ("mean_ttft", "median_ttft", "p99_ttft", "duration")
GOAL = 1.3                      # small_host_file median TTFT / host median TTFT
FIRST_USE_GOAL = 1.05           # a miss: our first use of a prefix / vLLM alone's
START_TIMEOUT_S, CLIENT_TIMEOUT_S, STOP_TIMEOUT_S = 300, 300, 20
PREFIX_FILE = "prefixes.json"   # beside bench.json: each prompt's prefix, numbered by first use
ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       THREADS_BIND: pinned_threads()}


class ServeFailed(HiCacheError):
    """A server that did not serve, or a client that did not finish: named by its run."""


def vllm_serve_figures(quick: bool = False, runs: tuple[str, ...] = tuple(RUNS)) -> list[dict]:
    """`runs` must start with `vllm`, the baseline of the others."""
    require_vllm()
    from .engine import write_llama, write_tokenizer

    requests, results, servers = (12 if quick else 24), {}, []
    with tempfile.TemporaryDirectory(prefix="hicache-vllm-serve-") as root, contextlib.ExitStack() as stack:
        model = write_tokenizer(write_llama(Path(root) / "llama", **LLAMA), LLAMA["vocab"])
        for run in runs:
            extra = RUNS[run] and _with_l3(RUNS[run], Path(root), stack)
            if isinstance(extra, str):
                results[run] = extra
            else:
                servers.append(stack.enter_context(Server(run, model, extra, Path(root) / run)))
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:
            server.wait_ready(deadline)
        _bench_serve(servers, requests)
        results.update((server.run, server.result(requests)) for server in servers)
    return _figures({run: results[run] for run in runs})


def _with_l3(extra: dict, root: Path, stack: contextlib.ExitStack) -> dict | str:
    """The run's config with where its L3 lives (a fresh file store, a fresh `mooncake_master`
    stopped with the bench), or why that L3 cannot run here."""
    if extra["storage"] == "file":
        return {**extra, "storage_path": str(root / "l3")}
    if extra["storage"] != "mooncake":
        return extra
    if importlib.util.find_spec("hicache_mooncake") is None or importlib.util.find_spec("mooncake") is None:
        return "mooncake not importable: pip install 'hicache-async[mooncake]'"
    from hicache_mooncake import MooncakeMaster

    master = stack.enter_context(MooncakeMaster(holder_bytes=256 << 20, log_path=str(root / "mooncake.log")))
    return {**extra, "mooncake_master": master.address, "mooncake_metadata": master.metadata_url}


class Server:
    """One vLLM OpenAI server (with our connector when `extra` is its config) in its own process
    group, so that stopping it stops its engine process too; it stops when this process dies."""

    def __init__(self, run: str, model: Path, extra: dict | None, workdir: Path) -> None:
        workdir.mkdir(parents=True)
        self.run, self.model, self.workdir, self.log = run, model, workdir, workdir / "server.log"
        port, parent = free_port(), os.getpid()
        self.base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "bfloat16",
               "--block-size", str(BLOCK), "--kv-cache-memory-bytes", str(DEVICE_KV), "--max-model-len", "2048",
               "--distributed-executor-backend", "uni"]
        if extra is not None:
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
                                                        "kv_load_failure_policy": "recompute",
                                                        "kv_connector_extra_config": extra})]
        with open(self.log, "wb") as out:     # SIGTERM, not SIGKILL, if we die: vLLM then stops its engine
            self.proc = launch.popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                     start_new_session=True, preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))

    def wait_ready(self, deadline: float) -> None:
        """Until /health answers; a server that exits first or is late is one error naming its
        run, the first exception in its log (vLLM re-raises the root cause as others) and the
        log's end."""
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.base}/health", timeout=2).status == 200:
                    return
            exited = self.proc.poll() is not None
            if exited or time.monotonic() > deadline:
                text = self.log.read_text(errors="replace")
                cause = next(iter(re.findall(r"^(?:.*\] )?([\w.]+(?:Error|Exception): .*)$", text, re.M)), "")
                what = (f"exited with code {self.proc.returncode} before serving" if exited
                        else f"not serving after {START_TIMEOUT_S} s")
                raise ServeFailed(f"vllm-serve {self.run}: server {what}: {cause} (log {self.log}, its end:)\n"
                                  f"{_tail(text)}")
            time.sleep(0.25)

    def client_args(self, requests: int) -> list[str]:
        """`vllm bench serve` arguments for this server; it writes `bench.json` beside the log."""
        return ["--backend", "vllm", "--base-url", self.base, "--model", str(self.model),
                "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(PREFIX),
                "--prefix-repetition-suffix-len", str(SUFFIX), "--prefix-repetition-num-prefixes", str(PREFIXES),
                "--prefix-repetition-output-len", "1", "--num-prompts", str(requests), "--max-concurrency", "1",
                "--seed", "0", "--temperature", "0", "--percentile-metrics", "ttft", "--metric-percentiles", "50,99",
                "--ready-check-timeout-sec", "60", "--disable-tqdm", "--save-result", "--save-detailed",
                "--result-dir", str(self.workdir), "--result-filename", "bench.json"]

    def result(self, requests: int) -> dict:
        """The client's TTFTs and duration in seconds, each prefix's first use's TTFTs, and the
        server's prefix-cache counters."""
        result = json.loads((self.workdir / "bench.json").read_text())
        if result["completed"] != requests:
            raise ServeFailed(f"vllm-serve {self.run}: {result['failed']} of {requests} requests failed "
                              f"(log {self.log})")
        first_uses = _first_uses(result["ttfts"], json.loads((self.workdir / PREFIX_FILE).read_text()))
        metrics = urllib.request.urlopen(f"{self.base}/metrics", timeout=10).read().decode()
        hits = _counter(metrics, "vllm:external_prefix_cache_hits_total")
        if self.run in MUST_HIT and not hits:
            raise ServeFailed(f"vllm-serve {self.run}: our connector served no tokens (log {self.log})")
        return {**{s: result[f"{s}_ms"] / 1e3 for s in STATS[:3]}, "duration": result["duration"],
                "first_uses": first_uses, "connector_hits": hits, "by_tier": tier_means(tier_ttft(metrics)),
                "prefix_cache_hits": _counter(metrics, "vllm:prefix_cache_hits_total")}

    def stop(self) -> None:
        """SIGTERM the process group (vLLM shuts its engine down), SIGKILL it if it lingers."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=STOP_TIMEOUT_S)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _bench_serve(servers: list[Server], requests: int) -> None:
    """One client process (`main` below) runs `vllm bench serve` against each server in turn."""
    argv, parent = json.dumps([server.client_args(requests) for server in servers]), os.getpid()
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, argv], capture_output=True, text=True,
                              env={**os.environ, **ENV}, timeout=CLIENT_TIMEOUT_S,
                              preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))
    except subprocess.TimeoutExpired:
        raise ServeFailed(f"vllm-serve: bench serve not done after {CLIENT_TIMEOUT_S} s") from None
    if proc.returncode != 0:
        run = next((s for s in servers if not (s.workdir / "bench.json").exists()), servers[-1]).run
        raise ServeFailed(f"vllm-serve {run}: bench serve exited with code {proc.returncode}:\n"
                          f"{_tail(proc.stdout + proc.stderr)}")


def _first_uses(ttfts: list[float], prefixes: list[int]) -> list[float]:
    """The TTFTs of the requests that use their prefix first, in seconds. The client's ready
    check sends the first prompt untimed before them, so its prefix has no first use here."""
    if len(ttfts) != len(prefixes):
        raise ServeFailed(f"vllm-serve: {len(ttfts)} TTFTs for {len(prefixes)} prompts")
    seen, firsts = {prefixes[0]}, []
    for ttft, prefix in zip(ttfts, prefixes):
        if prefix not in seen:
            seen.add(prefix)
            firsts.append(ttft)
    return firsts


def _counter(metrics: str, name: str) -> int:
    """A Prometheus counter's value, summed over its label sets."""
    return int(metric_sum(metrics, name))


def metric_sum(metrics: str, name: str, label: str = "") -> float:
    """A Prometheus series' value, summed over its label sets that carry `label` (k="v")."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)


def tier_ttft(metrics: str) -> dict[str, list[float]]:
    """Per tier that served most of a request's prompt (device, host, l3, none): the seconds to
    first tokens summed, and the requests, as the connector timed them (arrival to first
    token, in the engine)."""
    name = "vllm:hicache_time_to_first_token_seconds"
    return {tier: [metric_sum(metrics, f"{name}_sum", f'tier="{tier}"'),
                   metric_sum(metrics, f"{name}_count", f'tier="{tier}"')] for tier in TIERS}


def tier_means(sums: dict[str, list[float]]) -> dict[str, dict]:
    """Mean TTFT (ms) and requests per tier, from `tier_ttft`'s sums (added over servers)."""
    return {tier: {"requests": int(n), "mean_ttft_ms": round(total / n * 1e3, 1) if n else None}
            for tier, (total, n) in sums.items()}


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _figures(results: dict[str, dict | str]) -> list[dict]:
    """Each run's figures beside vLLM alone's; the goal ratio when both of its runs ran."""
    base, figures = results["vllm"], []
    for run, r in list(results.items())[1:]:
        if isinstance(r, str):
            figures += [skipped(f"vllm_serve_{run}_{s}_s", "s", f"vllm_serve_vllm_{s}_s", r) for s in STATS]
            continue
        figures += [figure(f"vllm_serve_{run}_{s}_s", r[s], "s", f"vllm_serve_vllm_{s}_s", base[s]) for s in STATS]
        miss = figure(f"vllm_serve_{run}_first_use_ttft_s", statistics.median(r["first_uses"]), "s",
                      "vllm_serve_vllm_first_use_ttft_s", statistics.median(base["first_uses"]))
        figures.append({**miss, "first_uses": [round(t, 3) for t in r["first_uses"]],
                        "baseline_first_uses": [round(t, 3) for t in base["first_uses"]],
                        "goal_max_ratio": FIRST_USE_GOAL, "goal_met": miss["ratio"] <= FIRST_USE_GOAL})
        hits = figure(f"vllm_serve_{run}_connector_hit_tokens", r["connector_hits"], "tokens",
                      "vllm_serve_vllm_prefix_cache_hit_tokens", base["prefix_cache_hits"])
        figures.append({**hits, "prefix_cache_hit_tokens": r["prefix_cache_hits"], "by_tier": r["by_tier"]})
    host, file_l3 = results.get("host"), results.get("small_host_file")
    if isinstance(host, dict) and isinstance(file_l3, dict):
        goal = figure("vllm_serve_file_l3_vs_host_median_ttft_s", file_l3["median_ttft"], "s",
                      "vllm_serve_host_median_ttft_s", host["median_ttft"])
        figures.append({**goal, "goal_max_ratio": GOAL, "goal_met": goal["ratio"] <= GOAL})
    return figures


def main() -> None:
    """`python -m hicache_vllm.bench.serve_figures ARGV_LISTS_JSON`: vLLM's `bench serve`
    (what `vllm bench serve` runs) for each argument list in turn, importing vLLM once. Beside
    each result it writes which prefix each prompt has: the client's seeded dataset, sampled
    again, in the order it sent them."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    for argv in json.loads(sys.argv[1]):
        args = parser.parse_args(argv)
        bench_serve(args)
        prompts = [r.prompt.split()[:PREFIX] for r in get_samples(args, get_tokenizer(args.model))]
        ids: dict[tuple, int] = {}
        Path(args.result_dir, PREFIX_FILE).write_text(json.dumps([ids.setdefault(tuple(p), len(ids)) for p in prompts]))


if __name__ == "__main__":
    main()
