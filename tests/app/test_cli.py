"""The CLI contract: usage errors exit 2 with one line naming the bad value; a run writes JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache_async.app.cli import main

BAD = [
    (["simulate", "--tp", "0"], "--tp: expected a positive integer, got 0"),
    (["simulate", "--device-pages", "-3"], "got -3"),
    (["simulate", "--page-size", "0"], "--page-size: expected a positive integer, got 0"),
    (["simulate", "--write-policy", "write_sideways"], "write_sideways"),
    (["simulate", "--prefetch-policy", "eventually"], "eventually"),
    (["simulate", "--key-scheme", "by-vibes"], "by-vibes"),
    (["simulate", "--storage", "tape"], "tape"),
    (["simulate", "--tp", "3"], "--tp 3"),
    (["simulate", "--pp", "5"], "--pp 5"),
    (["simulate", "--device-pages", "2"], "--device-pages 2"),
    (["simulate", "--page-size", "4096", "--device-pages", "1"], "--page-size 4096"),
    (["simulate", "--timeout", "0"], "--timeout"),
    (["simulate", "--requests", "many"], "many"),
    (["simulate", "--mooncake-master", "127.0.0.1:1"], "--mooncake-master"),
    (["bench", "--only", "warp_speed"], "warp_speed"),
    (["transmogrify"], "transmogrify"),
]


@pytest.mark.parametrize("argv,named", BAD)
def test_usage_errors_exit_2_with_one_line(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-async: error:"), err
    assert named in err


def test_a_bad_flag_from_the_shell_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "hicache_async", "simulate", "--host-pages", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--host-pages" in proc.stderr and "got 0" in proc.stderr


def test_simulate_writes_the_contract_json(tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_async", "simulate", "--requests", "8", "--turns", "4",
         "--device-pages", "40", "--host-pages", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    for field in ("world_size", "requests", "prompt_tokens", "tokens_from_l1", "tokens_from_l2",
                  "tokens_from_l3", "tokens_computed", "outputs_match_reference", "steps",
                  "on_step_us_p50", "on_step_us_p99", "transfers", "storage_errors"):
        assert field in result, field
    assert result["outputs_match_reference"] is True and result["requests"] == 8
    assert sum(result[k] for k in ("tokens_from_l1", "tokens_from_l2", "tokens_from_l3",
                                   "tokens_computed")) == result["prompt_tokens"]
    assert os.listdir(tmp_path / "cache" / "hicache-async" / "kv"), "default file storage unused"
    assert "outputs match the cache-less reference: yes" in proc.stdout


_IDLE_BURN = """
import os, resource, time
import hicache_async.app.cli            # what the console script imports first
import torch
src = torch.randn(8 << 20)
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)                      # a parallel op: torch's OpenMP workers ran it
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
before = cpu()
time.sleep(0.05)
print(os.environ["OMP_WAIT_POLICY"], round((cpu() - before) * 1e3, 1))
"""


@pytest.mark.parametrize("chosen", [None, "ACTIVE"])
def test_the_cli_sends_torchs_idle_workers_to_sleep_unless_the_user_chose(chosen):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if chosen:
        env["OMP_WAIT_POLICY"] = chosen
    proc = subprocess.run([sys.executable, "-c", _IDLE_BURN], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    policy, idle_cpu_ms = proc.stdout.split()
    assert policy == (chosen or "PASSIVE")
    if not chosen:      # a spinning worker burns ~9 ms of the 50 ms here; a sleeping one nothing
        assert float(idle_cpu_ms) < 3, idle_cpu_ms


def _preloaded_gomp_env() -> dict:
    """What vLLM's CPU platform gives its children: torch's libgomp preloaded, read at start."""
    libgomp = sorted(Path(torch.__file__).parent.glob("lib/libgomp*.so*"))
    assert libgomp, "torch ships no libgomp here"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    return {**env, "LD_PRELOAD": str(libgomp[0])}


def test_a_preloaded_libgomp_still_gets_sleeping_workers():
    """Preloaded, libgomp read no policy (a spinning worker burns ~10 ms here): the command runs
    itself afresh with one, as the first thing it does."""
    burn = "import hicache_async.app as app\napp.sleeping_workers()\nprint(app.CHOSEN)" + _IDLE_BURN
    proc = subprocess.run([sys.executable, "-c", burn], env=_preloaded_gomp_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rerun, policy, idle_cpu_ms = proc.stdout.split()
    assert (rerun, policy) == ("True", "PASSIVE")   # the policy was in its environment from the start
    assert float(idle_cpu_ms) < 3, idle_cpu_ms
    cli = subprocess.run([sys.executable, "-m", "hicache_async", "simulate", "--tenants", "0"],
                         env=_preloaded_gomp_env(), capture_output=True, text=True, timeout=120)
    assert (cli.returncode, cli.stderr.count("\n")) == (2, 1) and "tenants" in cli.stderr, cli.stderr
