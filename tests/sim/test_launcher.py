"""Simulated ranks: real processes, their groups, awaitable waits, and failure handling."""
from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hicache_async.errors import HiCacheError, SyncTimeout, UsageError
from hicache_async.parallel.dist_wait import wait_work
from hicache_async.sim.ranks.launcher import launch
from hicache_async.topology import RankCoords

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)   # signals one thread of a process
ROOT = Path(__file__).parents[2]   # where `tests.helpers` is importable


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def running(pids: dict[int, int]) -> list[int]:
    """The ranks (of `launch`'s on_start pids) whose process still runs. No wait: `launch`
    stops every rank before it returns or raises, so none may outlive it, even for a moment."""
    return [rank for rank, pid in pids.items() if alive(pid)]


def wait_until_dead(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_single_rank_still_runs_in_a_process():
    pids: dict[int, int] = {}
    [result] = launch(tp=1, pp=1, cp=1, target="tests.helpers.rank_targets:report_groups",
                      payload={"x": [1, 2]}, run_id="run-7", on_start=pids.__setitem__)
    assert result == {"rank": 0, "tp": None, "cp": None, "stage": None, "agree": None,
                      "prev": None, "next": None, "last_root": 0, "first": True, "last": True,
                      "tp_sum": 1, "run_id": "run-7", "payload": {"x": [1, 2]}}
    assert list(pids) == [0] and pids[0] != os.getpid()
    assert running(pids) == []


@pytest.mark.parametrize("tp,pp,cp,expected", [
    (2, 2, 1, [  # ranks 0,1 are stage 0; 2,3 stage 1
        dict(tp=[0, 1], cp=None, stage=[0, 1], agree=[0, 1], prev=None, next=2, last_root=2),
        dict(tp=[0, 1], cp=None, stage=[0, 1], agree=[0, 1], prev=None, next=3, last_root=2),
        dict(tp=[2, 3], cp=None, stage=[2, 3], agree=None, prev=0, next=None, last_root=2),
        dict(tp=[2, 3], cp=None, stage=[2, 3], agree=None, prev=1, next=None, last_root=2),
    ]),
    (2, 1, 2, [  # rank = cp * 2 + tp, one stage
        dict(tp=[0, 1], cp=[0, 2], stage=[0, 1, 2, 3], agree=[0, 1, 2, 3], prev=None, next=None,
             last_root=0),
        dict(tp=[0, 1], cp=[1, 3], stage=[0, 1, 2, 3], agree=[0, 1, 2, 3], prev=None, next=None,
             last_root=0),
        dict(tp=[2, 3], cp=[0, 2], stage=[0, 1, 2, 3], agree=[0, 1, 2, 3], prev=None, next=None,
             last_root=0),
        dict(tp=[2, 3], cp=[1, 3], stage=[0, 1, 2, 3], agree=[0, 1, 2, 3], prev=None, next=None,
             last_root=0),
    ]),
])
def test_groups_match_the_grid(tp, pp, cp, expected):
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.rank_targets:report_groups", payload={})
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got["rank"] == rank
        assert {k: got[k] for k in want} == want, f"rank {rank}"
        assert got["first"] == (want["prev"] is None)
        assert got["last"] == (want["next"] is None)
        assert got["tp_sum"] == tp  # a real all_reduce over the tp group


def test_killed_rank_is_named_and_the_others_stopped():
    pids: dict[int, int] = {}
    killed_at: list[float] = []

    def on_progress(info: dict) -> None:
        if info["rank"] == 1:
            os.kill(info["pid"], signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(HiCacheError) as caught:
        launch(tp=3, pp=1, cp=1, target="tests.helpers.rank_targets:all_reduce_until_killed", payload={},
               timeout_s=30, on_progress=on_progress, on_start=pids.__setitem__)
    assert time.monotonic() - killed_at[0] < 20
    assert str(caught.value) == "rank 1 (tp1 pp0 cp0) died without reporting (killed by SIGKILL)"
    assert len(pids) == 3 and running(pids) == []


def test_hanging_rank_times_out_the_others():
    pids: dict[int, int] = {}
    start = time.monotonic()
    with pytest.raises(SyncTimeout) as caught:
        launch(tp=2, pp=1, cp=1, target="tests.helpers.rank_targets:one_rank_hangs",
               payload={"hang_rank": 1, "hang_s": 60}, timeout_s=2, on_start=pids.__setitem__)
    assert time.monotonic() - start < 30
    assert str(caught.value) == "rank 0 (tp0 pp0 cp0): hang-test all_reduce: not complete after 2 s"
    assert len(pids) == 2 and running(pids) == []


def test_usage_error_keeps_its_type_and_message():
    pids: dict[int, int] = {}
    with pytest.raises(UsageError) as caught:
        launch(tp=2, pp=1, cp=1, target="tests.helpers.rank_targets:one_rank_misconfigured",
               payload={"bad_rank": 1}, timeout_s=30, on_start=pids.__setitem__)
    assert str(caught.value) == "rank 1 (tp1 pp0 cp0): --device-pages must be > 0, got 0"
    assert len(pids) == 2 and running(pids) == []


def test_bad_target_is_a_usage_error():
    with pytest.raises(UsageError, match=r"rank target 'tests.helpers.rank_targets:nope' is not an importable"):
        launch(tp=1, pp=1, cp=1, target="tests.helpers.rank_targets:nope", payload={})


def test_foreign_error_becomes_hicache_error_naming_its_class():
    with pytest.raises(HiCacheError) as caught:
        launch(tp=1, pp=1, cp=1, target="tests.helpers.rank_targets:unserialisable_result", payload={})
    assert type(caught.value) is HiCacheError
    assert str(caught.value).startswith("rank 0 (tp0 pp0 cp0): TypeError: Object of type Tensor")


def test_deadline_bounds_the_whole_run():
    pids: dict[int, int] = {}
    start = time.monotonic()
    with pytest.raises(HiCacheError, match="deadline of 8 s"):
        launch(tp=1, pp=1, cp=1, target="tests.helpers.rank_targets:sleep_forever", payload={}, deadline_s=8,
               on_start=pids.__setitem__)
    assert time.monotonic() - start < 15
    assert len(pids) == 1 and running(pids) == []


def test_awaited_all_reduce_costs_about_a_blocking_one():
    results = launch(tp=2, pp=1, cp=1, target="tests.helpers.rank_targets:time_all_reduce",
                     payload={"n": 300, "reps": 5})
    timing = results[0]
    print(f"1-element MIN all_reduce, 2 gloo ranks: {timing}")
    # Loose: the 2 cores are shared with other work (2.5x seen under a full test run). What it
    # guards is an awaited wait that falls back to sleeping or slow polls (milliseconds).
    assert timing["awaited_us"] < 5 * timing["blocking_us"]


LAUNCHER_SCRIPT = """
import signal
import sys
sys.path.insert(0, {root!r})
from hicache_async.sim.ranks.launcher import launch

if __name__ == "__main__":
    # Ctrl-C handled as in a terminal's foreground job, even when the suite runs as a background
    # job: that starts with SIGINT ignored, and a child inherits it (the tests would hang)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch(tp=2, pp=1, cp=1, target="tests.helpers.rank_targets:sleep_forever", payload={{}},
               on_progress=lambda info: print("PID", info["pid"], flush=True))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


def start_launcher(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    """Run a launcher in its own session; return it once both ranks reported their pids."""
    script = tmp_path / "launch_and_sleep.py"
    script.write_text(textwrap.dedent(LAUNCHER_SCRIPT.format(root=str(ROOT))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    text = ""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        while text.count("\n") < 2 and sel.select(max(0.0, deadline - time.monotonic())):
            chunk = os.read(proc.stdout.fileno(), 4096).decode()
            if not chunk:
                break
            text += chunk
    pids = [int(line.split()[1]) for line in text.splitlines()[:2]]
    if len(pids) < 2:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"launcher did not start its ranks: {proc.communicate(timeout=10)}")
    return proc, pids


@pytest.fixture
def launcher(tmp_path):
    """A launcher subprocess with two sleeping ranks; its whole session is killed afterwards."""
    proc, pids = start_launcher(tmp_path)
    yield proc, pids
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    proc.stderr.close()


def test_ctrl_c_stops_every_rank_quietly(launcher):
    proc, pids = launcher
    for pid in pids:
        os.kill(pid, signal.SIGINT)  # ranks leave Ctrl-C to the parent
    time.sleep(0.5)
    assert all(alive(pid) for pid in pids) and proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole foreground group
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "interrupted" in out
    assert "Traceback" not in err, err
    assert wait_until_dead(pids, 1.0) == []


def test_ctrl_c_taken_by_another_thread_still_stops_the_run(launcher):
    """The kernel may hand a process's SIGINT to any thread that does not block it (the
    launcher has OpenBLAS's workers): the main thread must still wake up and act on it."""
    proc, pids = launcher
    if SYS_TGKILL is None:
        pytest.skip(f"no tgkill number known for {os.uname().machine}")
    others = [int(tid) for tid in os.listdir(f"/proc/{proc.pid}/task") if int(tid) != proc.pid]
    assert others, "the launcher has no thread but its main one: nothing to hand the signal to"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, proc.pid, others[0], signal.SIGINT) == 0, ctypes.get_errno()
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "interrupted" in out
    assert "Traceback" not in err, err
    assert wait_until_dead(pids, 1.0) == []


def test_ranks_die_with_a_killed_parent(launcher):
    proc, pids = launcher
    proc.kill()  # no chance to clean up: only PR_SET_PDEATHSIG can stop the ranks
    proc.wait(timeout=10)
    assert wait_until_dead(pids, 10.0) == []


class BlockingWork:
    """A Work stand-in whose completion the test controls (gloo p2p style: never polled done)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.error = error

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        if not self.release.wait(10):
            raise RuntimeError("test work never released")
        if self.error is not None:
            raise self.error
        return True


COORDS = RankCoords.of(3, 2, 2, 1)


async def test_wait_work_times_out_with_one_line_naming_rank_and_operation():
    work = BlockingWork()
    with pytest.raises(SyncTimeout) as caught:
        await wait_work(work, what="pp_sync recv from rank 1", coords=COORDS, timeout_s=0.2)
    work.release.set()
    assert str(caught.value) == "rank 3 (tp1 pp1 cp0): pp_sync recv from rank 1: not complete after 0.2 s"


async def test_wait_work_reports_a_failed_work_without_gloo_noise():
    work = BlockingWork(RuntimeError("[gloo/pair.cc:553] Connection closed by peer\nmore"))
    work.release.set()
    with pytest.raises(HiCacheError) as caught:
        await wait_work(work, what="agree all_reduce", coords=COORDS, timeout_s=5)
    assert str(caught.value) == ("rank 3 (tp1 pp1 cp0): agree all_reduce failed: "
                                 "Connection closed by peer")

