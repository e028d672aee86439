"""The planner end to end: a replay's figures are a function of the trace and the flags alone
(not of the storage backend, nor of what else runs on the machine), TTFT stands beside no
cache and the ideal cache, and the reuse the cache missed is accounted for to the token.
With an ample modelled L3 the default file storage serves nearly all the oracle's reuse;
with a slow one it declines to fetch, and says so."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.installed_backend import installed_backend_env

TRACE = str(Path(__file__).parents[1] / "data" / "short_trace.jsonl")
SMALL = ["--device-pages", "40", "--host-pages", "64", "--timeout", "60"]
# Only these may differ between two replays of one trace with the same flags.
WALL = {"seconds", "on_step_us_p50", "on_step_us_p99", "admission_us_p50", "admission_us_p99", "peak_rss_mb",
        "run_id", "storage", "storage_used", "most_pending_sends"}
AMPLE_L3 = ["--l3-read-gbps", "1000", "--l3-write-gbps", "1000", "--l3-latency-us", "1"]


def _replay(trace: str, out: Path, *argv: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "hicache_async", "replay", trace, *argv, "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text())


def _check_account(out: dict) -> None:
    hits = out["tokens_from_l1"] + out["tokens_from_l2"] + out["tokens_from_l3"]
    assert sum(out["lost_tokens"].values()) == out["oracle_tokens"] - hits


@pytest.mark.parametrize("topology,backend", [([], "file"), ([], "mooncake"), (["--pp", "2"], "file")],
                         ids=["tp1-file", "tp1-mooncake", "pp2-file"])
def test_two_replays_agree_whatever_the_backend_and_the_load_beside_them(topology, backend, tmp_path):
    quiet = _replay(TRACE, tmp_path / "memory.json", *SMALL, *topology, "--storage", "memory")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:        # a backend of its own (mooncake: a master started for the run), on a busy machine
        busy = _replay(TRACE, tmp_path / f"{backend}.json", *SMALL, *topology, "--storage", backend)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert quiet["storage_used"] == "memory" and busy["storage_used"] == backend
    differ = {k: (quiet.get(k), busy.get(k)) for k in quiet.keys() | busy.keys()
              if k not in WALL and quiet.get(k) != busy.get(k)}
    assert not differ
    assert min(quiet["tokens_from_l1"], quiet["tokens_from_l2"], quiet["tokens_from_l3"]) > 0, quiet
    assert quiet["kv_mismatches"] == 0 and quiet["kv_verified_pages"] > 0
    _check_account(quiet)
    for prefix in ("", "baseline_", "oracle_"):
        p50, p90, p99 = (quiet[f"{prefix}ttft_ms_p{q}"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99 and quiet[f"{prefix}prompt_tokens_per_s"] > 0
    assert quiet["oracle_ttft_ms_p50"] < quiet["baseline_ttft_ms_p50"]


def _shared_prefix_trace(path: Path, prefixes: int = 12, requests: int = 96) -> str:
    """Requests that each open with one of a few long shared prefixes (6 blocks), then a
    block of their own, 60 ms apart: pools far smaller than the prefixes leave L3 to serve
    most of the reuse."""
    lines = []
    for i in range(requests):
        ids = [1000 * (i % prefixes) + b for b in range(6)] + [10**6 + i]
        lines.append(json.dumps({"timestamp": 60 * i, "input_length": 7 * 512 - 100, "output_length": 4,
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_an_ample_l3_serves_the_oracle_and_a_slow_one_says_why_it_does_not(tmp_path):
    trace = _shared_prefix_trace(tmp_path / "trace.jsonl")
    pools = ["--device-pages", "120", "--host-pages", "320"]
    ample = _replay(trace, tmp_path / "ample.json", *pools, *AMPLE_L3)
    assert ample["storage_used"] == "file" and ample["oracle_tokens"] > 0
    assert ample["tokens_from_l3"] > ample["tokens_from_l1"] + ample["tokens_from_l2"], ample
    assert ample["oracle_captured"] >= 0.95, ample["lost_tokens"]
    _check_account(ample)
    slow = _replay(trace, tmp_path / "slow.json", *pools, "--l3-read-gbps", "0.5")
    _check_account(slow)
    assert slow["oracle_captured"] < 0.5 and slow["tokens_from_l3"] < ample["tokens_from_l3"] / 2
    assert max(slow["lost_tokens"], key=slow["lost_tokens"].get) == "prefetch_declined_by_cost", slow["lost_tokens"]
    assert slow["ttft_ms_p90"] > ample["ttft_ms_p90"]


def test_one_ranks_failing_storage_costs_hits_not_agreement(tmp_path):
    """Rank 1's writes all fail while rank 0's succeed: the ranks still make the same choices
    (what a prefetch may ask L3 for is what every rank's backups retired), so the replay runs
    to the end, every page it serves verified, and its loss still accounted to the token."""
    env = installed_backend_env(tmp_path, "down1", "tests.helpers.one_rank_down:WritesFailOnRank1")
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "hicache_async", "replay", TRACE, "--tp", "2", "--storage", "down1",
                           *SMALL, *AMPLE_L3, "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["storage_errors"] > 0 and result["kv_mismatches"] == 0 and result["kv_verified_pages"] > 0
    assert result["tokens_from_l3"] == 0 < result["tokens_from_l1"] + result["tokens_from_l2"], result
    assert result["lost_tokens"].get("prefetch_cut_short", 0) > 0  # rank 1 read none: the agreed MIN is 0
    _check_account(result)
