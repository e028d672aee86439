"""A worker's flush on the way out: bounded, held against further signals, one line counting
the pages it did not write, and under write_back the host tier's pages L3 lacks written first.
(That a real engine calls it on its way out: `test_write_policies`' write_back test.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import torch
from hicache_vllm import shutdown
from hicache_vllm.plan import Job, Move, StepPlan
from structlog.testing import capture_logs

from hicache_async.keys import page_hashes
from hicache_async.transfer.objects import NO_TENANT
from tests.plugins.vllm.test_worker import kv_blocks, writer


def _done() -> Future:
    f = Future()
    f.set_result(3)
    return f


def test_a_flush_waits_for_jobs_that_finish_in_time():
    late = Future()
    threading.Timer(0.2, late.set_result, [1]).start()
    with capture_logs() as logs:
        assert shutdown.flush({_done(): 3, late: 1}, timeout=5.0) == 0
    assert late.done() and not logs


def test_jobs_past_the_flush_timeout_are_cancelled_in_one_line_counting_their_pages():
    with capture_logs() as logs:
        assert shutdown.flush({_done(): 3, Future(): 2, Future(): 4}, timeout=0.2) == 6
    (line,) = logs
    assert line["log_level"] == "warning" and (line["jobs"], line["pages"]) == (2, 6)
    assert "cancelled" in line["event"]


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
        assert shutdown.flush({job: 1}, timeout=10.0) == 0      # neither signal ended the process or the wait
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


def test_a_worker_with_a_backup_past_flush_timeout_closes_promptly_counting_what_it_did_not_write():
    w = writer(kv_blocks(), write_s=3.0, flush_timeout=0.5)
    w.host.tensor[:2] = torch.randn(2, *w.host.tensor.shape[1:]).to(torch.bfloat16)
    hashes = page_hashes(range(8), 4)
    w.pages.update({0: (hashes[0], NO_TENANT), 1: (hashes[1], NO_TENANT)})     # the slots hold those pages
    w.finish(StepPlan(step=1, backups=[Job(0, hashes, NO_TENANT, slots=[0, 1])]))
    started = time.monotonic()
    with capture_logs() as logs:
        w.close()
    assert time.monotonic() - started < 0.5 + 2.0        # not the 6 s the backup would take
    (line,) = [line for line in logs if "cancelled" in line["event"]]
    assert (line["jobs"], line["pages"]) == (1, 2) and not w.l3.objects


def test_under_write_back_close_writes_the_host_tiers_pages_l3_lacks():
    kv = kv_blocks()
    w = writer(kv, write_policy="write_back")
    hashes = page_hashes(range(12), 4)
    w.finish(StepPlan(step=1, saves=[Move("r", [0, 1, 2], [3, 4, 5], hashes, NO_TENANT)]))
    w.jobs.in_l3.add(hashes[0])                                # stored before: not written again
    with capture_logs() as logs:
        w.close()
    assert not [line for line in logs if line["log_level"] == "warning"]
    assert w.jobs._prefetch(Job(1, hashes[1:], NO_TENANT, slots=[6, 7])) == 2
    assert torch.equal(w.host.tensor[6, 0], kv[0][4]) and torch.equal(w.host.tensor[7, 1], kv[1][5])
    assert w.jobs._prefetch(Job(2, hashes[:1], NO_TENANT, slots=[6])) == 0


def test_under_write_through_close_leaves_the_host_tier_alone():
    w = writer(kv_blocks(), write_policy="write_through")
    hashes = page_hashes(range(8), 4)
    w.finish(StepPlan(step=1, saves=[Move("r", [0, 1], [3, 4], hashes, NO_TENANT)]))
    w.close()
    assert not w.l3.objects
