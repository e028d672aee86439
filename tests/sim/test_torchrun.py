"""Ranks that torchrun launches: each process is one rank, rank 0 reports for all of them.

Real torchrun (the one shipped with torch), real processes, gloo over loopback; every run is
bounded by a timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache_async.ports import free_port

BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
HICACHE = str(BIN / "hicache-async")
ROOT = Path(__file__).parents[2]   # where `tests` is importable
TRACE = str(ROOT / "tests" / "data" / "short_trace.jsonl")
RUN_TIMEOUT_S = 300


def torchrun(nproc: int, *args: str, cwd: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC --no-python hicache-async ARGS` on a free port (not
    torchrun's 29500, which a concurrent run may hold)."""
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_ASYNC_FAULT"}
    if fault:
        env["HICACHE_ASYNC_FAULT"] = fault
    return subprocess.run([TORCHRUN, "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
                           "--no-python", HICACHE, *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def our_lines(text: str) -> list[str]:
    """What hicache-async printed on stderr, without torch's and torchrun's own logging."""
    return [line for line in text.splitlines() if line.startswith("hicache-async")]


def test_torchrun_tp2_pp2_runs_each_process_as_one_rank(tmp_path):
    done = torchrun(4, "simulate", "--tp", "2", "--pp", "2", "--requests", "12",
                    "--storage-path", str(tmp_path / "l3"), "--json", str(tmp_path / "out.json"),
                    cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("hicache-async simulate: world 4 (tp2 pp2 cp1)") == 1, done.stdout
    assert "outputs match the cache-less reference: yes" in done.stdout
    assert our_lines(done.stderr) == []
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 4 and out["requests"] == 12
    assert out["outputs_match_reference"] is True and out["ranks_agree"] is True
    assert out["kv_mismatches"] == 0 and out["kv_verified_pages"] > 0   # the reference KV reached every rank


def test_torchrun_replay_on_two_ranks(tmp_path):
    done = torchrun(2, "replay", TRACE, "--tp", "2", "--limit", "16",
                    "--storage", "memory", "--device-pages", "40", "--host-pages", "64",
                    "--json", str(tmp_path / "out.json"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("hicache-async replay short_trace.jsonl: 16 requests, world 2") == 1
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 2 and out["ranks_agree"] and out["kv_mismatches"] == 0
    assert out["kv_verified_pages"] > 0


def test_two_torchrun_agents_as_two_nodes(tmp_path):
    """--nnodes 2 on one machine: two agents meet at --master-addr, one rank each."""
    port = str(free_port())
    argv = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", port, "--no-python", HICACHE, "simulate", "--tp", "2", "--requests", "6",
            "--storage", "memory", "--json", str(tmp_path / "out.json")]
    nodes = [subprocess.Popen(argv[:1] + ["--node-rank", str(n)] + argv[1:], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    try:
        outs = [node.communicate(timeout=RUN_TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outs
    assert outs[0][0].count("hicache-async simulate: world 2") == 1 and outs[1][0] == ""
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["world_size"] == 2 and out["outputs_match_reference"] and out["kv_mismatches"] == 0


def test_world_size_must_match_the_topology(tmp_path):
    done = torchrun(2, "simulate", "--tp", "2", "--pp", "2", cwd=tmp_path)
    assert done.returncode != 0
    assert our_lines(done.stderr) == ["hicache-async: error: --tp 2 x --pp 2 x --cp 1 is 4 ranks, but "
                                      "torchrun started WORLD_SIZE=2 processes"], done.stderr


def test_a_failing_run_is_one_line_from_the_rank_that_failed_first(tmp_path):
    done = torchrun(2, "simulate", "--tp", "2", "--requests", "6",
                    "--storage", "memory", cwd=tmp_path, fault="copy-error")
    assert done.returncode != 0
    [line] = our_lines(done.stderr)
    assert line.startswith("hicache-async: error: rank ") and "injected fault" in line, line
    assert done.stdout == ""


def ranks_by_hand(world: int, command: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Start `world` processes with torchrun's variables set by hand (as srun or a job script
    would): rank 0 hosts the rendezvous store itself. Each process's own exit code and output."""
    port = str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_other_ranks_exit_with_rank_0s_code_and_print_nothing(tmp_path):
    ok = ranks_by_hand(2, [HICACHE, "simulate", "--tp", "2", "--requests", "6", "--storage", "memory"], tmp_path)
    assert [r.returncode for r in ok] == [0, 0], [r.stderr for r in ok]
    assert ok[0].stdout.count("hicache-async simulate: world 2") == 1
    assert ok[1].stdout == "" and our_lines(ok[1].stderr) == []
    bad = ranks_by_hand(2, [HICACHE, "simulate", "--tp", "4", "--requests", "6"], tmp_path)
    assert [r.returncode for r in bad] == [2, 2]
    assert our_lines(bad[0].stderr) == ["hicache-async: error: --tp 4 x --pp 1 x --cp 1 is 4 ranks, but "
                                        "torchrun started WORLD_SIZE=2 processes"]
    assert bad[1].stdout == "" and our_lines(bad[1].stderr) == []


LEAD_SHIPPED = """
import json, sys
from hicache_async.sim.ranks import torchrun

def job():
    scratch = sys.argv[1]
    reports = torchrun.lead(tp=2, pp=1, cp=1, target="tests.helpers.rank_targets:read_shipped", run_id="t",
                            payload={"file": scratch + "/kv.json", "seed": 7}, timeout_s=30,
                            on_progress=lambda info: None, scratch=scratch)
    print(json.dumps(reports))
    return 0

sys.exit(torchrun.lead_or_follow(job))
"""


def test_the_scratch_directory_travels_to_every_rank(tmp_path):
    """Rank 0's prepared files reach the others through the store, each rank reading its own
    copy, so ranks on other machines need no shared file system."""
    scratch = tmp_path / "rank0-scratch"
    scratch.mkdir()
    (scratch / "kv.json").write_text('{"pages": 3}')
    done = ranks_by_hand(2, [sys.executable, "-c", LEAD_SHIPPED, str(scratch)], tmp_path)
    assert [r.returncode for r in done] == [0, 0], [r.stderr for r in done]
    mine, theirs = json.loads(done[0].stdout)
    assert mine == {"path": str(scratch / "kv.json"), "text": '{"pages": 3}', "seed": 7}
    assert theirs["text"] == '{"pages": 3}' and theirs["seed"] == 7
    assert not theirs["path"].startswith(str(scratch)) and not os.path.exists(theirs["path"])  # removed after
