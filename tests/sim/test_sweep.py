"""Planning sweeps: `--sweep` over capacities and hardware flags, bad values are one line and
exit 2, capacities read in the modelled model's tokens and KV bytes, and the plot's ticks
read as a person writes them."""
import csv
import json
import os
import subprocess
import sys

import pytest

from hicache_async.app.cli import main
from hicache_async.sim.jobs import units
from hicache_async.sim.jobs.capacity import parse_sweep

LLAMA_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2     # layers x kv heads x head dim x (K, V) x fp16


def _trace(tmp_path) -> str:
    """Six conversations of three turns over a shared 512-token system prompt (block 0), each
    turn's prompt extending the last: reuse from every tier on small pools."""
    lines, t = [], 0
    for turn in range(3):
        for conv in range(6):
            ids = [0] + [100 * conv + k for k in range(1, turn + 2)]
            lines.append(json.dumps({"timestamp": t, "input_length": 512 * len(ids) - 100,
                                     "output_length": 4, "hash_ids": ids}))
            t += 150
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _sweep(trace: str, tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "-m", "hicache_async", "replay", trace, "--device-pages", "40",
                           "--host-pages", "48", "--timeout", "30", "--json", str(out), *argv],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done, json.loads(out.read_text())


@pytest.mark.parametrize("sweep,named", [
    ("colour=1,2", "unknown name 'colour'"),
    ("host-pages", "expected NAME=A,B,C"),
    ("host-pages=64,1.5", "'1.5' is not a positive integer"),
    ("l3-read-gbps=2,x", "'x' is not a positive number"),
    ("l3-read-gbps=2,0", "'0' is not a positive number"),
    ("pcie-gbps=-4", "'-4' is not a positive number"),
    ("l3-latency-us=inf", "'inf' is not a positive number"),
    ("l3-write-gbps=nan", "'nan' is not a positive number"),
    ("kv-bytes-per-token=128K,big", "'big' is not a positive size"),
    ("l3-read-gbps=", "'' is not a positive number"),
])
def test_a_bad_sweep_is_one_line_naming_the_bad_part(sweep, named, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n')
    assert main(["replay", str(trace), "--sweep", sweep]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-async: error: --sweep"), err
    assert named in err, err


def test_hardware_sweeps_take_numbers_and_sizes_sorted_once():
    assert parse_sweep("l3-read-gbps=25,2.5,10,2.5", "file") == ("l3-read-gbps", [2.5, 10, 25])
    assert parse_sweep("l3-latency-us=0.5,100", "file") == ("l3-latency-us", [0.5, 100])
    assert parse_sweep("kv-bytes-per-token=64K,131072", "file") == ("kv-bytes-per-token", [65536, 131072])
    assert parse_sweep("l3-capacity=2G,512M", "file") == ("l3-capacity", [512 << 20, 2 << 30])


@pytest.mark.parametrize("value,text", [
    (16 * 2**30, "16 GiB"), (1.5 * 2**40, "1.5 TiB"), (512 * 2**20, "512 MiB"), (8192, "8 KiB"),
    (2**20 - 100, "1 MiB"), (100, "100 B"), (0, "0 B"),
])
def test_sizes_read_in_binary_units(value, text):
    assert units.size(value) == text


@pytest.mark.parametrize("value,text", [
    (1_000_000, "1M tokens"), (1_048_576, "1.05M tokens"), (262_144, "262K tokens"),
    (5_120_000, "5.12M tokens"), (2048, "2,048 tokens"), (145_000_000, "145M tokens"),
])
def test_token_counts_read_in_decimal_units(value, text):
    assert units.tokens(value) == text


@pytest.mark.parametrize("value,text", [(2, "2"), (2.5, "2.5"), (0.125, "0.125"), (1000, "1,000"),
                                        (12345, "12,300"), (1 / 3, "0.333")])
def test_numbers_have_no_exponent_and_three_digits(value, text):
    assert units.number(value) == text


def test_host_capacity_reads_in_the_modelled_models_kv_not_the_replays(tmp_path):
    trace = _trace(tmp_path)
    done, table = _sweep(trace, tmp_path, "--storage", "memory", "--sweep", "host-pages=48,2048")
    big = table["rows"][1]
    # Llama-3.1-8B (the default model): 2,048 pages of 64 tokens are 16 GiB, not the replay's 16 MiB.
    assert big["capacity_tokens"] == 2048 * 64 and big["capacity_gib"] == 16
    assert big["kv_bytes_per_token"] == LLAMA_8B_KV_BYTES_PER_TOKEN
    assert "16 GiB" in done.stdout and "131K tokens" in done.stdout, done.stdout
    assert table["rows"][0]["capacity_gib"] == 48 * 64 * LLAMA_8B_KV_BYTES_PER_TOKEN / 2**30


def test_an_l3_read_bandwidth_sweep_writes_rows_csv_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    trace = _trace(tmp_path)
    done, table = _sweep(trace, tmp_path, "--sweep", "l3-read-gbps=2.5,25", "--plot", str(tmp_path / "s.png"))
    assert table["sweep"] == "l3-read-gbps" and [r["value"] for r in table["rows"]] == [2.5, 25]
    for row, run in zip(table["rows"], table["runs"]):
        assert run["hardware"]["l3_read_gbps"] == row["value"]      # the swept value reached the run
        for field in ("hit_ratio", "oracle_ratio", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99",
                      "baseline_ttft_ms_p90", "oracle_ttft_ms_p90"):
            assert row[field] == run[field], field
        assert row["l1_ratio"] + row["l2_ratio"] + row["l3_ratio"] == pytest.approx(row["hit_ratio"], abs=2e-4)
        assert row["capacity_tokens"] == 48 * 64            # a hardware sweep states the host pool it held
        assert row["capacity_gib"] == round(48 * 64 * run["kv_bytes_per_token"] / 2**30, 3)
        assert 0 < row["hit_ratio"] <= row["oracle_ratio"]
    # At 2.5 GB/s fetching a 64-token page of Llama-3.1-8B KV (8 MiB) costs more than recomputing it; at 25 less.
    slow, fast = table["rows"]
    assert slow["l3_ratio"] < fast["l3_ratio"]
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["l3-read-gbps"] for r in rows] == ["2.5", "25"] and float(rows[1]["ttft_ms_p90"]) == fast["ttft_ms_p90"]
    assert os.path.getsize(tmp_path / "s.png") > 10_000
    assert "2.5 GB/s" in done.stdout and "TTFT p90" in done.stdout


def _table(sweep: str, unit: str, values: list, tokens: list[int]) -> dict:
    rows = [{"value": v, "kv_bytes_per_token": LLAMA_8B_KV_BYTES_PER_TOKEN, "capacity_tokens": t,
             "capacity_gib": t * LLAMA_8B_KV_BYTES_PER_TOKEN / 2**30, "l1_ratio": 0.1, "l2_ratio": 0.2,
             "l3_ratio": 0.1, "hit_ratio": 0.4, "oracle_ratio": 0.6, "ttft_ms_p90": 900.0,
             "baseline_ttft_ms_p90": 1500.0, "oracle_ttft_ms_p90": 700.0} for v, t in zip(values, tokens)]
    return {"sweep": sweep, "model": "llama-3.1-8b", "label": sweep.rsplit("-", 1)[0], "unit": unit,
            "capacity_of": "L2 host", "trace": "t.jsonl", "rows": rows}


@pytest.mark.parametrize("table,bottom,top", [
    (_table("host-pages", "pages", [2048, 8192, 32768], [131072, 524288, 2097152]),
     ["16 GiB", "64 GiB", "256 GiB"], ["131K", "524K", "2.1M"]),
    (_table("l3-read-gbps", "GB/s", [2, 5, 10, 25], [1048576] * 4), ["2", "5", "10", "25"], None),
    (_table("l3-latency-us", "µs", [1, 100, 1000], [1048576] * 3), ["1", "100", "1,000"], None),
])
def test_plot_ticks_are_the_swept_values_as_a_person_writes_them(table, bottom, top):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    from hicache_async.sim.jobs.sweep_plot import draw

    fig = draw(table)
    fig.canvas.draw()
    hit, ttft = fig.axes[:2]
    assert [t.get_text() for t in ttft.get_xticklabels()] == bottom
    assert ttft.xaxis.get_offset_text().get_text() == "" and not ttft.xaxis.get_minorticklabels()
    assert (table["unit"] in ttft.get_xlabel()) == (top is None)     # GB/s, µs; a capacity says KV
    if top:
        tokens = hit.child_axes[0]
        assert [t.get_text() for t in tokens.get_xticklabels()] == top and "tokens" in tokens.get_xlabel()
    else:
        assert not hit.child_axes


def test_ttft_spanning_decades_reads_in_plain_seconds():
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    import re

    from hicache_async.sim.jobs.sweep_plot import draw

    table = _table("l3-read-gbps", "GB/s", [2, 10], [1048576] * 2)
    for row, p90 in zip(table["rows"], (218_643.0, 5_886.0)):
        row.update(ttft_ms_p90=p90, baseline_ttft_ms_p90=297_187.0, oracle_ttft_ms_p90=3_657.0)
    fig = draw(table)
    fig.canvas.draw()
    ttft = fig.axes[1]
    assert ttft.get_yscale() == "log" and ttft.get_ylabel() == "TTFT p90 (s)"
    labels = [t.get_text() for t in ttft.get_yticklabels() if t.get_text()]
    assert {"10", "100"} <= set(labels) and all(re.fullmatch(r"[\d,.]+", t) for t in labels), labels
    assert not [t.get_text() for t in ttft.get_yticklabels(minor=True) if t.get_text()]
