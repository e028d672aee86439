"""`bench --only vllm-serve`, reduced: real vLLM OpenAI servers (CPU build) driven by vLLM's own
`bench serve` client, few requests, three of the five runs."""
import pytest

from hicache_async.app.bench.vllm_engine import write_llama, write_tokenizer
from hicache_async.app.bench.vllm_serve_figures import LLAMA, STATS, ServeFailed, Server, vllm_serve_figures

pytest.importorskip("hicache_vllm")

RUNS = ("vllm", "host", "small_host_file")


def test_the_serving_bench_reports_each_run_beside_vllm_alone():
    figures = {f["name"]: f for f in vllm_serve_figures(quick=True, runs=RUNS)}
    names = [f"vllm_serve_{run}_{stat}_s" for run in RUNS[1:] for stat in STATS]
    names += [f"vllm_serve_{run}_connector_hit_tokens" for run in RUNS[1:]]
    assert sorted(figures) == sorted(names + ["vllm_serve_file_l3_vs_host_median_ttft_s"])
    for name in names:
        fig = figures[name]
        assert fig["value"] >= 0 and fig["baseline_value"] >= 0 and "skipped" not in fig, fig
    for stat in ("mean_ttft", "median_ttft", "p99_ttft"):
        fig = figures[f"vllm_serve_host_{stat}_s"]
        assert 0 < fig["baseline_value"] < 60 and 0 < fig["value"] < 60, fig
    # 12 requests over 6 prefixes: 6 repeat a prefix; vLLM's 96 device blocks keep about one
    # prompt, so the host tier serves most repeats (46 pages of 32 tokens each) and its median
    # request is one of them. How many L3 serves varies from run to run (4,288-5,888 tokens seen).
    hits = {run: figures[f"vllm_serve_{run}_connector_hit_tokens"]["value"] for run in RUNS[1:]}
    assert hits["host"] >= 3 * 46 * 32 and hits["small_host_file"] > 0, hits
    host = figures["vllm_serve_host_median_ttft_s"]
    assert host["value"] < host["baseline_value"], host
    goal = figures["vllm_serve_file_l3_vs_host_median_ttft_s"]
    assert goal["goal_max_ratio"] == 1.3 and goal["goal_met"] == (goal["ratio"] <= 1.3)


def test_a_server_that_fails_to_start_is_one_error_naming_its_run_and_log(tmp_path):
    model = write_tokenizer(write_llama(tmp_path / "llama", **LLAMA), LLAMA["vocab"])
    with Server("tape_l3", model, {"storage": "tape"}, tmp_path / "tape_l3") as server:
        with pytest.raises(ServeFailed, match="vllm-serve tape_l3: server exited") as failed:
            server.wait_ready(deadline=float("inf"))
    first_line = str(failed.value).splitlines()[0]
    assert "UsageError: kv_connector_extra_config: unknown storage 'tape'" in first_line
    assert str(server.log) in first_line
    assert server.proc.returncode is not None
