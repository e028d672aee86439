"""A worker's flush on the way out, alone: bounded, held against further signals, and one line
naming how many L3 jobs it abandoned."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from hicache_vllm import shutdown
from structlog.testing import capture_logs


def _done() -> Future:
    f = Future()
    f.set_result(3)
    return f


def test_a_flush_waits_for_jobs_that_finish_in_time():
    late = Future()
    threading.Timer(0.2, late.set_result, [1]).start()
    with capture_logs() as logs:
        assert shutdown.flush({_done(), late}, timeout=5.0) == 0
    assert late.done() and not logs


def test_jobs_past_the_flush_timeout_are_abandoned_in_one_line():
    with capture_logs() as logs:
        assert shutdown.flush({_done(), Future(), Future()}, timeout=0.2) == 2
    (line,) = logs
    assert line["log_level"] == "warning" and line["jobs"] == 2 and "abandoned" in line["event"]


def test_sigterm_and_sigint_during_a_flush_are_held_then_the_handlers_come_back():
    before = {s: signal.getsignal(s) for s in shutdown.SIGNALS}
    job = Future()

    def signal_then_finish():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)         # the main thread handles both while it waits
        job.set_result(1)

    threading.Timer(0.2, signal_then_finish).start()
    with capture_logs() as logs:
        assert shutdown.flush({job}, timeout=10.0) == 0      # neither signal ended the process or the wait
    assert sorted(line["signal"] for line in logs) == ["SIGINT", "SIGTERM"]
    assert {s: signal.getsignal(s) for s in shutdown.SIGNALS} == before


def test_sigterm_in_a_process_with_no_handler_exits_through_python_shutdown(tmp_path):
    """An in-process engine: SIGTERM would end the process on the spot, skipping the atexit
    hook that flushes; with `on_signals` it exits (143) through that hook, and says at start
    that vLLM's worker window is shorter than the flush."""
    script = tmp_path / "worker.py"
    script.write_text("import atexit, os, signal, time\n"
                      "from hicache_vllm import shutdown\n"
                      "atexit.register(lambda: print('flushed', flush=True))\n"
                      "shutdown.on_signals(flush_timeout=30)\n"
                      "os.kill(os.getpid(), signal.SIGTERM)\n"
                      "time.sleep(30)\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"}     # vLLM's 5 s
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 128 + signal.SIGTERM and "flushed" in done.stdout
    assert "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS is 5" in done.stdout + done.stderr
