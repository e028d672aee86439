"""The scale check: a 12,000-request Mooncake-format trace replayed whole on one rank, timed.

Builds the trace from a smaller one: copies of it one after another in time, each copy's
hash ids moved to a range of their own (so a copy reuses within itself as the original
does, never across copies), cut to `--requests`, and every prompt shortened by one factor to
`--prompt-tokens` in all (a shortened prompt keeps its leading blocks, so shared prefixes
stay shared). Then runs `hicache-async replay` on it with default pools and file storage
and reports wall seconds and the peak RSS of the whole process tree (the CLI and its rank),
sampled from /proc.

    python scripts/scale_trace.py ../shared/traces/synthetic_trace.jsonl --out /tmp/scale.jsonl [-- REPLAY FLAGS]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

BLOCK_TOKENS = 512


def build(source: str, out: str, requests: int, prompt_tokens: int) -> dict:
    """Write the scaled trace to `out`; its request count and prompt tokens."""
    with open(source) as f:
        base = [json.loads(line) for line in f if line.strip()]
    span_ms = max(r["timestamp"] for r in base) + 1000        # a quiet second between copies
    id_range = max(i for r in base for i in r["hash_ids"]) + 1
    copies = [{**r, "timestamp": r["timestamp"] + k * span_ms, "hash_ids": [i + k * id_range for i in r["hash_ids"]]}
              for k in range(math.ceil(requests / len(base))) for r in base][:requests]
    factor = min(1.0, prompt_tokens / sum(r["input_length"] for r in copies))
    total = 0
    with open(out, "w") as f:
        for r in copies:
            length = max(1, round(r["input_length"] * factor))
            r = {**r, "input_length": length, "hash_ids": r["hash_ids"][:math.ceil(length / BLOCK_TOKENS)]}
            total += length
            f.write(json.dumps(r) + "\n")
    return {"requests": len(copies), "prompt_tokens": total, "length_factor": round(factor, 4)}


def _tree_rss_bytes(root: int) -> int:
    """Resident bytes of `root` and every process below it."""
    parents, rss = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(name)] = int(fields[1])
        rss[int(name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid and p not in tree]
        tree.update(kids)
        frontier += kids
    return sum(rss.get(p, 0) for p in tree)


def replay(trace: str, extra: list[str]) -> dict:
    """Run the replay, sampling the process tree's RSS twice a second."""
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        out_json = os.path.join(tmp, "replay.json")
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "hicache_async", "replay", trace, "--json", out_json, *extra])
        peak, done = 0, threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(0.5):
                peak = max(peak, _tree_rss_bytes(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = proc.wait()
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
        result = {}
        if os.path.exists(out_json):
            with open(out_json) as f:
                result = json.load(f)
    return {"exit_code": code, "wall_seconds": round(seconds, 1), "peak_tree_rss_mib": round(peak / 2**20, 1),
            **{k: result.get(k) for k in ("requests", "prompt_tokens", "hit_ratio", "oracle_ratio",
                                         "peak_rss_mb", "seconds", "virtual_seconds")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a Mooncake-format trace to scale up")
    p.add_argument("--out", required=True, help="where to write the scaled trace")
    p.add_argument("--requests", type=int, default=12_000)
    p.add_argument("--prompt-tokens", type=float, default=145e6)
    p.add_argument("--build-only", action="store_true", help="write the trace, do not replay it")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)     # after --: flags for hicache-async replay
    ns = p.parse_args(argv[:cut])
    built = build(ns.source, ns.out, ns.requests, int(ns.prompt_tokens))
    print(json.dumps({"trace": ns.out, **built}), flush=True)
    if ns.build_only:
        return 0
    figures = replay(ns.out, argv[cut + 1:])
    print(json.dumps(figures), flush=True)
    return figures["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
