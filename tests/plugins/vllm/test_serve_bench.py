"""`bench --only vllm-serve`, reduced: real vLLM OpenAI servers (CPU build) driven by vLLM's own
`bench serve` client, few requests, two of the five runs: vLLM alone and our host tier. (The
file-L3 goal row is made from the runs' figures: checked below from given ones. A server of a
small host tier over a file L3 serving prefixes from it: `test_metrics_and_events.py`.)"""
import os
import statistics

import pytest

from hicache_vllm.bench.engine import pinned_threads, write_llama, write_tokenizer
from hicache_vllm.bench.serve_figures import (ENV, LLAMA, STATS, ServeFailed, Server, _figures, _first_uses,
                                              vllm_serve_figures)

pytest.importorskip("hicache_vllm")

RUNS = ("vllm", "host")


def test_the_serving_bench_reports_each_run_beside_vllm_alone():
    figures = {f["name"]: f for f in vllm_serve_figures(quick=True, runs=RUNS)}
    names = [f"vllm_serve_{run}_{stat}_s" for run in RUNS[1:] for stat in STATS]
    names += [f"vllm_serve_{run}_connector_hit_tokens" for run in RUNS[1:]]
    names += [f"vllm_serve_{run}_first_use_ttft_s" for run in RUNS[1:]]
    assert sorted(figures) == sorted(names)       # no file-L3 goal row without its run
    for name in names:
        fig = figures[name]
        assert fig["value"] >= 0 and fig["baseline_value"] >= 0 and "skipped" not in fig, fig
    for stat in ("mean_ttft", "median_ttft", "p99_ttft"):
        fig = figures[f"vllm_serve_host_{stat}_s"]
        assert 0 < fig["baseline_value"] < 60 and 0 < fig["value"] < 60, fig
    # 12 requests over 6 prefixes: 6 repeat a prefix; vLLM's 96 device blocks keep about one
    # prompt, so the host tier serves most repeats (46 pages of 32 tokens each) and its median
    # request is one of them.
    hits = figures["vllm_serve_host_connector_hit_tokens"]["value"]
    assert hits >= 3 * 46 * 32, hits
    host = figures["vllm_serve_host_median_ttft_s"]
    assert host["value"] < host["baseline_value"], host
    # 5 first uses a side: the ready check already sent the first prompt's prefix. Each runs the
    # whole prefill, so each is slower than the host tier's median request, a hit: a prompt
    # taken for a first use that was not one would be a hit there.
    for run in RUNS[1:]:
        miss = figures[f"vllm_serve_{run}_first_use_ttft_s"]
        assert len(miss["first_uses"]) == len(miss["baseline_first_uses"]) == 5, miss
        assert miss["value"] == pytest.approx(statistics.median(miss["first_uses"]), abs=0.002), miss
        assert miss["baseline_value"] == pytest.approx(statistics.median(miss["baseline_first_uses"]), abs=0.002)
    assert min(figures["vllm_serve_host_first_use_ttft_s"]["first_uses"]) > host["value"]


def _measured(median: float, first_uses: list[float]) -> dict:
    return {"mean_ttft": 9.0, "median_ttft": median, "p99_ttft": 9.0, "duration": 30.0, "first_uses": first_uses,
            "connector_hits": 100, "prefix_cache_hits": 50, "by_tier": {"host": {"requests": 3, "mean_ttft_ms": 400.0}}}


@pytest.mark.parametrize("file_median,met", [(0.65, True), (0.66, False)])
def test_the_goals_are_the_file_l3_median_over_the_host_median_and_the_first_uses_median(file_median, met):
    """1.3 times the host tier's 0.5 s median is 0.65 s: met at it, missed just past it; the
    first uses' goal compares medians, so two slow outliers of five do not miss it."""
    results = {"vllm": _measured(1.0, [2.0, 2.0, 2.0, 2.0, 2.0]), "host": _measured(0.5, [2.0, 2.1, 2.0, 2.0, 2.0]),
               "small_host_file": _measured(file_median, [2.1, 2.0, 2.0, 9.0, 9.0])}
    figures = {f["name"]: f for f in _figures(results)}
    goal = figures["vllm_serve_file_l3_vs_host_median_ttft_s"]
    assert (goal["value"], goal["baseline_value"], goal["goal_met"]) == (file_median, 0.5, met)
    assert goal["ratio"] == round(file_median / 0.5, 3) and goal["goal_max_ratio"] == 1.3
    first = figures["vllm_serve_small_host_file_first_use_ttft_s"]
    assert (first["value"], first["baseline_value"], first["ratio"], first["goal_met"]) == (2.1, 2.0, 1.05, True)
    assert figures["vllm_serve_host_first_use_ttft_s"]["value"] == 2.0
    assert figures["vllm_serve_host_connector_hit_tokens"]["by_tier"] == {"host": {"requests": 3, "mean_ttft_ms": 400.0}}


def test_each_prefix_first_use_is_timed_once_and_the_ready_checked_prefix_never():
    assert _first_uses([0.1, 0.5, 0.2, 0.6, 0.3], [0, 1, 0, 2, 1]) == [0.5, 0.6]
    with pytest.raises(ServeFailed, match="2 TTFTs for 3 prompts"):
        _first_uses([0.1, 0.2], [0, 1, 2])


def test_every_server_and_engine_is_bound_to_the_same_cores():
    assert ENV["VLLM_CPU_OMP_THREADS_BIND"] == pinned_threads()
    cores = sorted(os.sched_getaffinity(0))
    assert pinned_threads() == ",".join(map(str, cores))
    ranks = [r.split(",") for r in pinned_threads(2).split("|")]
    assert len(ranks) == 2 and all(ranks) and (len(cores) < 2 or not set(ranks[0]) & set(ranks[1]))


def test_a_server_that_fails_to_start_is_one_error_naming_its_run_and_log(tmp_path):
    model = write_tokenizer(write_llama(tmp_path / "llama", **LLAMA), LLAMA["vocab"])
    with Server("tape_l3", model, {"storage": "tape"}, tmp_path / "tape_l3") as server:
        with pytest.raises(ServeFailed, match="vllm-serve tape_l3: server exited") as failed:
            server.wait_ready(deadline=float("inf"))
    first_line = str(failed.value).splitlines()[0]
    assert "UsageError: kv_connector_extra_config: unknown storage 'tape'" in first_line
    assert str(server.log) in first_line
    assert server.proc.returncode is not None
