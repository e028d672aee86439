"""Warm starts (`launch.py`, `forkserver.py`): a fork of a process that imported a module
already is, to whoever started it, the process `python -m M` would have been."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hicache_vllm.bench.launch import WarmProcess, WarmStarts

CHILD = "tests.helpers.warm_child"
MARKER = "xml.dom.minidom"      # imported by the fork server only: a child that has it is a fork


@pytest.fixture
def server(tmp_path):
    warm = WarmStarts((CHILD,), (MARKER,), dict(os.environ), tmp_path / "forkserver.log")
    yield warm
    warm.close()


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", CHILD, *args]


def test_a_warm_start_is_its_own_process_with_its_streams_environment_and_exit(server, tmp_path):
    flushed, err = tmp_path / "atexit", tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = server.popen(_child("3"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "WARM_TOKEN": "t1", "ATEXIT_FILE": str(flushed)}, cwd=str(tmp_path),
                            start_new_session=True)
    assert isinstance(proc, WarmProcess)
    proc.stdin.write("hello\n")
    proc.stdin.close()
    seen = json.loads(proc.stdout.readline())
    assert seen == {"argv": ["3"], "pid": proc.pid, "sid": proc.pid, "cwd": str(tmp_path), "token": "t1",
                    "name": "__main__", "warm": True}
    assert proc.wait(30) == 3 and proc.poll() == 3
    assert err.read_text() == "hello\n"
    assert flushed.read_text() == "flushed"        # it exited through interpreter shutdown
    assert server.starts == 1


def test_a_killed_warm_start_says_its_signal_and_a_short_wait_times_out_first(server, tmp_path):
    proc = server.popen(_child("sleep"), stdout=subprocess.PIPE,
                        env={**os.environ, "ATEXIT_FILE": str(tmp_path / "atexit")})
    assert json.loads(proc.stdout.readline())["warm"]
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_what_a_fork_cannot_take_from_its_request_starts_cold(server, tmp_path):
    threads = {**os.environ, "ATEXIT_FILE": str(tmp_path / "atexit"),
               "OMP_NUM_THREADS": str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)}
    proc = server.popen(_child("0"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=threads)
    assert isinstance(proc, subprocess.Popen) and not json.loads(proc.stdout.readline())["warm"]
    assert proc.wait(60) == 0
    for args in ([sys.executable, "-m", "json.tool", "--help"], [sys.executable, "-c", "pass"]):
        proc = server.popen(args, stdout=subprocess.DEVNULL)
        assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert server.starts == 0


def test_forks_get_sigterm_when_their_server_ends(server, tmp_path):
    proc = server.popen(_child("sleep"), stdout=subprocess.PIPE,
                        env={**os.environ, "ATEXIT_FILE": str(tmp_path / "atexit")})
    json.loads(proc.stdout.readline())
    server.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return      # dead, not yet reaped by whoever adopted it
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"fork {proc.pid} outlived its server")


def test_a_server_that_cannot_import_is_one_error_naming_its_log(tmp_path):
    broken = WarmStarts((CHILD,), ("no_such_module_here",), dict(os.environ), tmp_path / "forkserver.log")
    with pytest.raises(RuntimeError, match="fork server did not start .*forkserver.log"):
        broken.popen(_child("0"))
    assert "no_such_module_here" in (tmp_path / "forkserver.log").read_text()


def test_a_server_running_a_thread_threading_cannot_see_refuses_to_fork_in_one_line(tmp_path):
    threaded = WarmStarts((CHILD,), ("tests.helpers.hidden_thread",), dict(os.environ), tmp_path / "forkserver.log")
    try:
        with pytest.raises(RuntimeError, match=r"^the fork server runs 2 threads, not 1: .*hidden_thread\)$"):
            threaded.popen(_child("0"), stdout=subprocess.DEVNULL)
        assert threaded.proc.poll() is None     # it refused, and still serves
    finally:
        threaded.close()
    assert "forkserver: the fork server runs 2 threads" in (tmp_path / "forkserver.log").read_text()
