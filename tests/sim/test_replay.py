"""`hicache-async replay`: a short checked-in trace served from L1, L2 and L3 with every reused
page verified; wrong KV fails the run or misses, never passes silently; bad input is one line
naming the file and line; TP x PP and CP runs agree; a capacity sweep writes its table."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_async.app.cli import main

TRACE = str(Path(__file__).parents[1] / "data" / "short_trace.jsonl")
# Pools small enough for this 48-request trace (largest request: 31 pages) to use every tier.
SMALL = ["--device-pages", "40", "--host-pages", "64", "--timeout", "30"]


def _replay(*argv: str, fault: str | None = None, timeout: int = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_ASYNC_FAULT"}
    if fault:
        env["HICACHE_ASYNC_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "hicache_async", "replay", TRACE, *SMALL, *argv],
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    """One run on file storage, kept for the tests that read its result or its objects."""
    root = tmp_path_factory.mktemp("replay")
    done = _replay("--storage-path", str(root / "l3"), "--json", str(root / "out.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    return root, json.loads((root / "out.json").read_text()), done.stdout


def test_every_tier_serves_verified_kv_close_to_the_oracle(file_run):
    _, out, stdout = file_run
    for field in ("requests", "prompt_tokens", "tokens_from_l1", "tokens_from_l2", "tokens_from_l3",
                  "tokens_computed", "oracle_tokens", "hit_ratio", "oracle_ratio", "kv_verified_pages",
                  "kv_mismatches", "admission_us_p50", "admission_us_p99", "on_step_us_p50",
                  "on_step_us_p99", "peak_rss_mb", "seconds", "world_size", "storage_errors",
                  "corrupt_objects", "missing_objects", "l3_bytes_written", "l3_bytes_read", "ranks_agree"):
        assert field in out, field
    assert out["requests"] == 48 and out["kv_mismatches"] == 0 and out["ranks_agree"]
    assert min(out["tokens_from_l1"], out["tokens_from_l2"], out["tokens_from_l3"]) > 0, out
    hits = out["tokens_from_l1"] + out["tokens_from_l2"] + out["tokens_from_l3"]
    assert 0.9 * out["oracle_tokens"] <= hits <= out["oracle_tokens"]
    assert out["kv_verified_pages"] * 64 == hits        # every reused page was checked
    assert "KV verified" in stdout and "oracle" in stdout


def test_a_corrupted_stored_object_is_a_miss_not_wrong_kv(file_run, tmp_path):
    root, _, _ = file_run
    objects = [p for p in (root / "l3").rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert objects
    for path in objects:                  # flip the last payload byte of every object
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    done = _replay("--storage-path", str(root / "l3"), "--json", str(tmp_path / "again.json"))
    assert done.returncode == 0, done.stderr
    out = json.loads((tmp_path / "again.json").read_text())
    assert out["corrupt_objects"] > 0 and out["kv_mismatches"] == 0, out


@pytest.mark.parametrize("fault,tier", [("noise-load", "l2"), ("corrupt-stored", "l3")])
def test_wrong_kv_from_a_host_page_or_a_stored_object_fails_the_run(fault, tier, tmp_path):
    done = _replay("--storage", "memory", "--json", str(tmp_path / "out.json"), fault=fault)
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert "KV mismatch in request" in error and "page" in error and "layer" in error, error
    assert f"served from {tier}" in error, error
    assert json.loads((tmp_path / "out.json").read_text())["kv_mismatches"] > 0


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    return str(path)


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
BAD = [
    ("missing", None, ":1:"),
    ("not json", GOOD + GOOD + "{oops\n", ":3: not JSON"),
    ("no field", GOOD + '{"timestamp": 5, "input_length": 600, "output_length": 2}\n', ":2: missing field 'hash_ids'"),
    ("short ids", '{"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2]}\n',
     ":1: 2 hash_ids do not cover input_length 1100"),
    ("empty", "\n", ":1: empty trace"),
]


@pytest.mark.parametrize("name,text,named", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_naming_file_and_line(name, text, named, tmp_path, capsys):
    path = _write(tmp_path, text) if text is not None else str(tmp_path / "absent.jsonl")
    assert main(["replay", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-async: error:"), err
    assert path + named in err, err


@pytest.mark.parametrize("argv,named", [
    (["--page-size", "48"], ":1: --page-size 48 does not divide"),
    (["--device-pages", "4"], ":1 (600 prompt + 2 output tokens need 38 pages of 16)"),
    (["--sweep", "l3-capacity=1M", "--storage", "memory"], "memory storage has no capacity"),
    (["--sweep", "colour=1,2"], "colour"),
    (["--plot", "x.png"], "--plot needs --sweep"),
])
def test_bad_settings_are_usage_errors(argv, named, tmp_path, capsys):
    assert main(["replay", _write(tmp_path, GOOD), "--page-size", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


@pytest.mark.parametrize("topology", [["--tp", "2", "--pp", "2"], ["--cp", "2"]], ids=["tp2pp2", "cp2"])
def test_parallel_ranks_verify_and_agree(topology, tmp_path):
    done = _replay("--storage", "memory", "--limit", "32", *topology, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 4 if "--tp" in topology else out["world_size"] == 2
    assert out["ranks_agree"] and out["kv_mismatches"] == 0 and out["kv_verified_pages"] > 0
    assert out["tokens_from_l2"] + out["tokens_from_l3"] > 0


def test_a_host_sweep_writes_its_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    done = _replay("--storage", "memory", "--limit", "24", "--sweep", "host-pages=32,128",
                   "--json", str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png"))
    assert done.returncode == 0, done.stdout + done.stderr
    table = json.loads((tmp_path / "sweep.json").read_text())
    assert table["sweep"] == "host-pages" and [r["value"] for r in table["rows"]] == [32, 128]
    with open(tmp_path / "sweep.csv") as f:                 # beside --json by default
        rows = list(csv.DictReader(f))
    assert [r["host-pages"] for r in rows] == ["32", "128"]
    assert all(float(r["hit_ratio"]) <= float(r["oracle_ratio"]) for r in rows)
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert "sweep over host-pages" in done.stdout
