"""vLLM fleet figures (`bench --only vllm-fleet`): two vLLM OpenAI servers, each pinned to a core
of its own, over one shared Mooncake L3, against the same seeded multi-turn stream (see
`fleet_stream.py`: sessions over three shared system prompts, three requests in flight; about
3x the two servers' device KV). The arms:
- `vllm`: no connector, round-robin (the baseline every output is compared with);
- `host_only`: each server its own host tier, no L3, round-robin;
- `shared_l3`: host tiers over one `mooncake_master` and segment holder, round-robin;
- `routed`: the same, each prompt sent by `hicache_vllm.router` (Dynamo's indexer);
- `ideal`: one server, twice the device KV and host tier, same L3, on one core: the hit rate
  a fleet that shared everything would reach.
The model runs in float32, so a prefix computed in another batch shape rounds alike and
every greedy output must equal vLLM alone's. Tokens by tier are the servers' own counters:
device (vLLM's prefix cache), host and L3 (ours), computed (the rest of the prompt tokens).
Each arm with our connector also says, from its servers' counters, its mean TTFT by the tier
that served most of a request's prompt (`by_tier`, timed in the engine), and where its time
went (`time_split`, seconds summed over servers): L3 reads and writes (our timed calls), the
store's processes (CPU of the master and segment holder) and prefill (vLLM's own).

Servers start an arm group at a time (memory: about 1.5 GiB each) and are idle while other
arms run; start-up is most of the bench's time.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hicache_async.app.bench.figure import figure, skipped
from hicache_async.ports import free_port
from hicache_async.sim.ranks.launcher import die_with_parent

from . import launch, require_vllm
from .fleet_stream import Shape, play, stream
from .serve_figures import ENV, LLAMA, START_TIMEOUT_S, Server, _counter, metric_sum, tier_means, tier_ttft

ARMS = ("vllm", "host_only", "shared_l3", "routed", "ideal")
GROUPS = (("vllm", "host_only"), ("shared_l3", "routed", "ideal"))     # started together
BLOCK, DEVICE_BLOCKS, HOST_PAGES = 32, 56, 112       # per server: 1,792 tokens on device, 3,584 in host
KV_BLOCK_BYTES = 2 * LLAMA["layers"] * LLAMA["hidden"] * 4 * BLOCK     # float32 K and V
MAX_LEN = (DEVICE_BLOCKS - 2) * BLOCK              # vLLM keeps a block back: the longest prompt is 1,632
MODEL_NAME = "fleet"
FULL, QUICK = Shape(), Shape(systems=2, system_tokens=512, sessions=5, turns=3, in_flight=2)
GOALS = {"ideal_vs_shared_l3_hit_rate": round(1 / 0.9, 3), "shared_l3_vs_host_only_mean_ttft": 0.95,
         "routed_vs_shared_l3_mean_ttft": 1.0, "routed_vs_ideal_mean_ttft": 1.25, "routed_busiest_vs_idlest": 1.5}


class FleetServer(Server):
    """A serving-bench server with the fleet's model settings, pinned to `core`, optionally
    publishing KV events on `events` (ZMQ port, replay port); `port` to restart one in place."""

    def __init__(self, run: str, model: Path, extra: dict | None, workdir: Path, core: int, device_blocks: int,
                 events: tuple[int, int] | None = None, port: int | None = None) -> None:
        workdir.mkdir(parents=True)
        self.run, self.model, self.workdir, self.log = run, model, workdir, workdir / "server.log"
        self.events = events
        port, parent = port or free_port(), os.getpid()
        self.base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", str(MAX_LEN),
               "--kv-cache-memory-bytes", str(device_blocks * KV_BLOCK_BYTES), "--distributed-executor-backend", "uni"]
        if extra is not None:
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
                                                        "kv_load_failure_policy": "recompute",
                                                        "kv_connector_extra_config": extra})]
        if events is not None:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": f"tcp://*:{events[0]}",
                                                      "replay_endpoint": f"tcp://*:{events[1]}"})]
        env = {**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        with open(self.log, "wb") as out:
            self.proc = launch.popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))

    def tokens(self) -> dict[str, int]:
        """Prompt tokens, and those served by device, host and L3, from the server's counters."""
        text = urllib.request.urlopen(f"{self.base}/metrics", timeout=10).read().decode()
        tier = {t: int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("vllm:hicache_prefix_tokens_total{") and f'tier="{t}"' in line))
                for t in ("host", "l3")}
        seconds = "vllm:hicache_l3_call_seconds_sum"
        return {"prompt": _counter(text, "vllm:prompt_tokens_total"),
                "device": _counter(text, "vllm:prefix_cache_hits_total"), **tier, "by_tier": tier_ttft(text),
                "split": {"l3_read_s": metric_sum(text, seconds, 'op="read"'),
                          "l3_write_s": metric_sum(text, seconds, 'op="write"'),
                          "prefill_s": metric_sum(text, "vllm:request_prefill_time_seconds_sum")}}


def vllm_fleet_figures(quick: bool = False, arms: tuple[str, ...] = ARMS) -> list[dict]:
    """`arms` must start with `vllm`, the baseline of the others."""
    require_vllm()
    try:
        import hicache_mooncake  # noqa: F401
        import mooncake  # noqa: F401
        import dynamo.llm  # noqa: F401
    except ImportError as exc:
        return [skipped(f"vllm_fleet_{a}_mean_ttft_s", "s", "vllm_fleet_vllm_mean_ttft_s", f"not importable: {exc}")
                for a in arms[1:]]
    return _figures(run_arms(QUICK if quick else FULL, arms))


def run_arms(shape: Shape, arms: tuple[str, ...], seed: int = 0, l3_reads: str = "auto") -> dict[str, dict]:
    """Each arm's result object (see `_result`), arms run one after another; `l3_reads` the
    L3 arms' setting (a test of the fleet's tiers forces reads, whatever the machine's speed)."""
    from .engine import write_llama, write_tokenizer

    turns, results = stream(shape, seed), {}
    with tempfile.TemporaryDirectory(prefix="hicache-vllm-fleet-") as root:
        model = write_tokenizer(write_llama(Path(root) / "llama", **LLAMA), LLAMA["vocab"])
        for group in GROUPS:
            todo = [a for a in group if a in arms]
            if not todo:
                continue
            with contextlib.ExitStack() as stack:
                stores: dict[str, object] = {}
                fleets = {a: _start(a, model, Path(root), stack, stores, l3_reads) for a in todo}
                deadline = time.monotonic() + START_TIMEOUT_S
                for servers in fleets.values():
                    for s in servers:
                        s.wait_ready(deadline)
                for arm, servers in fleets.items():
                    before = _cpu_s(stores.get(arm))
                    results[arm] = _play(arm, servers, turns, shape, Path(root), stack)
                    if arm in stores:
                        results[arm]["time_split"]["store_cpu_s"] = round(_cpu_s(stores[arm]) - before, 2)
    base = [a.text for a in results["vllm"]["answers"]] if "vllm" in results else None
    for r in results.values():
        r["outputs_equal_vllm"] = base is not None and [a.text for a in r.pop("answers")] == base
    return results


def _cpu_s(master) -> float:
    """CPU seconds the store's processes (master, segment holder) have used; 0 without a store."""
    total = 0
    for pid in master.pids if master is not None else ():
        with contextlib.suppress(OSError):
            total += sum(int(v) for v in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
    return total / os.sysconf("SC_CLK_TCK")


def _start(arm: str, model: Path, root: Path, stack: contextlib.ExitStack, stores: dict,
           l3_reads: str) -> list[FleetServer]:
    """The arm's servers (and its own Mooncake master and segment holder when it has an L3,
    put in `stores`)."""
    extra = None if arm == "vllm" else {"storage": "none", "host_pages": HOST_PAGES}
    if arm in ("shared_l3", "routed", "ideal"):
        from hicache_mooncake import MooncakeMaster

        master = stores[arm] = stack.enter_context(MooncakeMaster(holder_bytes=512 << 20,
                                                                  log_path=str(root / f"{arm}-mooncake.log")))
        extra = {"storage": "mooncake", "host_pages": HOST_PAGES, "storage_optional": False, "l3_reads": l3_reads,
                 "mooncake_master": master.address, "mooncake_metadata": master.metadata_url}
    if arm == "ideal":
        return [stack.enter_context(FleetServer(arm, model, {**extra, "host_pages": 2 * HOST_PAGES},
                                                root / arm / "0", 0, 2 * DEVICE_BLOCKS))]
    return [stack.enter_context(FleetServer(arm, model, extra, root / arm / str(core), core, DEVICE_BLOCKS,
                                            (free_port(), free_port()) if arm == "routed" else None))
            for core in (0, 1)]


def _play(arm: str, servers: list[FleetServer], turns, shape: Shape, root: Path, stack) -> dict:
    urls, sent, on_answer = [s.base for s in servers], [0] * len(servers), None
    if arm == "routed":
        router, tickets = _router(servers, root, stack), []

        def pick(prompt: list[int]) -> int:
            tickets.append(router.route(prompt))
            return tickets[-1].server

        def on_answer(i: int, answer) -> None:
            router.done(tickets[i])
    else:
        def pick(prompt: list[int]) -> int:
            i = sum(sent) % len(servers)
            sent[i] += 1
            return i
    answers, duration = play(turns, urls, MODEL_NAME, pick, shape, on_answer)
    return _result(arm, answers, duration, [s.tokens() for s in servers], len(servers))


def _router(servers: list[FleetServer], root: Path, stack: contextlib.ExitStack):
    """Dynamo's standalone indexer hearing the servers, and our router over it."""
    from ..router import Member, Router
    from .fleet_indexer import Indexer

    indexer = stack.enter_context(Indexer(root / "indexer.log"))
    router = Router([Member(s.base, f"tcp://127.0.0.1:{s.events[0]}", f"tcp://127.0.0.1:{s.events[1]}")
                     for s in servers], indexer.url, MODEL_NAME, BLOCK)
    router.register()
    return router


def _result(arm: str, answers, duration: float, counts: list[dict], n: int) -> dict:
    ttft = sorted(a.ttft_s * 1e3 for a in answers)
    prompt = sum(c["prompt"] for c in counts)
    by_tier = {t: [sum(c["by_tier"][t][i] for c in counts) for i in (0, 1)] for t in counts[0]["by_tier"]}
    split = {k: round(sum(c["split"][k] for c in counts), 2) for k in counts[0]["split"]}
    tokens = {t: sum(c[t] for c in counts) for t in ("device", "host", "l3")}
    tokens["computed"] = prompt - sum(tokens.values())
    return {"arm": arm, "mean_ttft_ms": round(statistics.fmean(ttft), 1),
            "median_ttft_ms": round(statistics.median(ttft), 1),
            "p99_ttft_ms": round(ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], 1),
            "duration_s": round(duration, 2), "prompt_tokens": prompt, "tokens": tokens,
            "hit_rate": round(1 - tokens["computed"] / prompt, 4) if prompt else 0.0,
            "requests_per_server": [sum(a.server == i for a in answers) for i in range(n)], "answers": answers,
            "by_tier": tier_means(by_tier), "time_split": split}


def _figures(results: dict[str, dict]) -> list[dict]:
    """Per arm its mean TTFT beside vLLM alone's, the arm's object attached; then the goals."""
    base = results["vllm"]
    rows = [{**figure(f"vllm_fleet_{arm}_mean_ttft_s", r["mean_ttft_ms"] / 1e3, "s", "vllm_fleet_vllm_mean_ttft_s",
                      base["mean_ttft_ms"] / 1e3), "arm": r} for arm, r in results.items() if arm != "vllm"]
    rows.insert(0, {**figure("vllm_fleet_vllm_mean_ttft_s", base["mean_ttft_ms"] / 1e3, "s",
                             "vllm_fleet_vllm_mean_ttft_s", base["mean_ttft_ms"] / 1e3), "arm": base})

    def goal(name: str, value: float, baseline_name: str, baseline: float, unit: str = "ratio") -> None:
        row = figure(f"vllm_fleet_{name}", value, unit, baseline_name, baseline)
        rows.append({**row, "goal_max_ratio": GOALS[name],
                     "goal_met": row["ratio"] is not None and row["ratio"] <= GOALS[name]})

    shared, host, routed, ideal = (results.get(a) for a in ("shared_l3", "host_only", "routed", "ideal"))
    if shared and ideal:
        goal("ideal_vs_shared_l3_hit_rate", ideal["hit_rate"], "vllm_fleet_shared_l3_hit_rate", shared["hit_rate"])
    if shared and host:
        goal("shared_l3_vs_host_only_mean_ttft", shared["mean_ttft_ms"], "vllm_fleet_host_only_mean_ttft_ms",
             host["mean_ttft_ms"], "ms")
    if routed and shared:
        goal("routed_vs_shared_l3_mean_ttft", routed["mean_ttft_ms"], "vllm_fleet_shared_l3_mean_ttft_ms",
             shared["mean_ttft_ms"], "ms")
    if routed and ideal:
        goal("routed_vs_ideal_mean_ttft", routed["mean_ttft_ms"], "vllm_fleet_ideal_mean_ttft_ms",
             ideal["mean_ttft_ms"], "ms")
    if routed:
        per = routed["requests_per_server"]
        goal("routed_busiest_vs_idlest", max(per), "vllm_fleet_routed_idlest_requests", min(per), "requests")
    return rows

