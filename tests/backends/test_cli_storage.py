"""L3 through the real CLI: separate `hicache-async simulate` processes share file storage and a
Mooncake master's segment holder; an unreachable master fails fast; a master killed mid-run
costs storage errors, not the run."""
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hicache_mooncake import MooncakeMaster
from hicache_async.ports import free_port

CLI = [str(Path(sys.executable).parent / "hicache-async")]
if not Path(CLI[0]).exists():
    CLI = [sys.executable, "-m", "hicache_async"]
SMALL = ["--requests", "12", "--turns", "4", "--max-new", "4", "--device-pages", "48", "--host-pages", "64",
         "--page-size", "8", "--prefetch-threshold", "8"]


def _simulate(tmp_path: Path, name: str, *flags: str, timeout: float = 240) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([*CLI, "simulate", *SMALL, *flags, "--json", str(out)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _shares_l3(first: dict, second: dict) -> None:
    assert first["outputs_match_reference"] is True and second["outputs_match_reference"] is True
    assert first["storage_errors"] == second["storage_errors"] == 0
    assert second["tokens_from_l3"] > 0 and second["tokens_from_l3"] > first["tokens_from_l3"], (first, second)


def test_two_runs_share_a_storage_directory(tmp_path):
    path = str(tmp_path / "kv")
    first = _simulate(tmp_path, "first", "--storage-path", path)
    second = _simulate(tmp_path, "second", "--storage-path", path)
    _shares_l3(first, second)


def test_two_runs_share_one_mooncake_master(tmp_path):
    with MooncakeMaster(holder_bytes=256 << 20, log_path=str(tmp_path / "master.log")) as master:
        flags = ["--storage", "mooncake", "--mooncake-master", master.address,
                 "--mooncake-metadata", master.metadata_url]
        first = _simulate(tmp_path, "first", *flags)
        second = _simulate(tmp_path, "second", *flags)
    _shares_l3(first, second)


def test_unreachable_master_exits_1_with_one_line(tmp_path):
    port = free_port()
    started = time.monotonic()
    proc = subprocess.run([*CLI, "simulate", *SMALL, "--storage", "mooncake",
                           "--mooncake-master", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("hicache-async: error:") and f"127.0.0.1:{port}" in proc.stderr
    assert time.monotonic() - started < 30


def test_unreachable_master_degrades_to_l1_l2_when_asked(tmp_path):
    port = free_port()
    out = tmp_path / "degraded.json"
    proc = subprocess.run([*CLI, "simulate", *SMALL, "--storage", "mooncake", "--storage-optional",
                           "--mooncake-master", f"127.0.0.1:{port}", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"127.0.0.1:{port} unreachable; running on L1/L2 only" in proc.stderr
    result = json.loads(out.read_text())
    assert result["storage_used"] == "none" and result["outputs_match_reference"]
    assert result["tokens_from_l3"] == 0 and result["tokens_from_l2"] + result["tokens_from_l1"] > 0


def _puts(master: MooncakeMaster) -> int:
    """Batch puts the master has served, from its Prometheus metrics (0 while unreadable)."""
    try:
        with urllib.request.urlopen(f"http://{master.host}:{master.metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return 0
    m = re.search(r"^master_batch_put_start_requests_total (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def test_master_killed_mid_run_costs_errors_not_the_run(tmp_path):
    out = tmp_path / "run.json"
    with MooncakeMaster(holder_bytes=256 << 20, log_path=str(tmp_path / "master.log")) as master:
        proc = subprocess.Popen(
            [*CLI, "simulate", "--requests", "40", "--turns", "4", "--max-new", "4", "--device-pages", "48",
             "--host-pages", "64", "--page-size", "8", "--prefetch-threshold", "8", "--storage", "mooncake",
             "--mooncake-master", master.address, "--mooncake-metadata", master.metadata_url, "--json", str(out)],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.txt", "w"),
            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
        try:
            deadline = time.monotonic() + 120
            while _puts(master) < 3:                    # the run is underway: it has backed up pages
                assert proc.poll() is None, "simulate finished before the master could be killed"
                assert time.monotonic() < deadline, "simulate never wrote to the master"
                time.sleep(0.1)
            master.kill_master()
            time.sleep(1.0)
            master.start()                              # same ports; the holder re-mounts by itself
            rc = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert rc == 0, stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["outputs_match_reference"] is True
    assert result["storage_errors"] > 0, result
