"""Run a target on tp x pp x cp simulated ranks: one OS process each, joined by gloo on loopback.

The launcher hosts the ranks' rendezvous store itself, on a port the kernel gives it: a port
picked here for rank 0 to bind later could be taken in between. Ranks send JSON text to the
parent over a pipe (progress, a result, or a one-line error); no user data is pickled. The
parent returns the results in rank order or raises the root cause: the first error reported, or
a rank that died without reporting. Children die with the parent (a thread waits on its pidfd),
ignore the terminal's Ctrl-C (the parent stops them), and are always stopped before `launch`
returns or raises. Each rank is a fork of multiprocessing's fork server, which imports torch
once for all this process's launches (an interpreter start each would import it again); a rank
takes the environment of the `launch` that started it, not the server's.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import multiprocessing as mp
import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist

from ...errors import HiCacheError, UsageError
from ...topology import RankCoords
from .target import RankContext, error_type, one_line, run_target

__all__ = ["RankContext", "die_with_parent", "launch"]  # a target gets a RankContext

RANK_IMPORTS = ("torch", "torch.distributed", "hicache_async.sim.ranks.target")
STOP_GRACE_S = 2.0
DEATH_GRACE_S = 0.5   # how long a reported error waits for the silent death that may have caused it
LINGER_S = 10.0  # a failed rank keeps its sockets open this long so peers cannot report first
PR_SET_PDEATHSIG = 1
WAKE_S = 0.5     # the longest the parent sleeps: a Ctrl-C the kernel hands to another of its
                 # threads (OpenBLAS starts some) is only acted on once the main thread wakes


@dataclass
class _Rank:
    coords: RankCoords
    process: mp.process.BaseProcess
    conn: Connection
    result: Any = None
    done: bool = False
    closed: bool = False    # its end of the pipe is gone: it exited


def launch(*, tp: int, pp: int, cp: int, target: str, payload: dict, timeout_s: float = 60.0,
           run_id: str | None = None, on_progress: Callable[[dict], None] | None = None,
           on_start: Callable[[int, int], None] | None = None, deadline_s: float | None = None) -> list[dict]:
    """Run `target(ctx)` ("package.module:function", sync or async) on every rank.

    `timeout_s` bounds each cross-rank wait; `deadline_s` (optional) bounds the whole run.
    `on_progress` receives each ctx.progress() dict with a "rank" key added; `on_start`
    receives (rank, pid) as each rank's process starts: ranks are the fork server's children,
    not the caller's, so this is how a caller learns which processes are its ranks.
    """
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp)):
        if size < 1:
            raise UsageError(f"{name} must be >= 1, got {size}")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    try:
        spec = json.dumps({
            "tp": tp, "pp": pp, "cp": cp, "target": target, "payload": payload,
            "timeout_s": timeout_s, "run_id": run_id or uuid.uuid4().hex[:12],
            "store_port": store.port, "parent_pid": os.getpid(),
            "env": {**os.environ, "OMP_NUM_THREADS": "1"},
        })
    except TypeError as exc:
        raise UsageError(f"payload is not JSON-serialisable: {exc}") from None
    ranks: list[_Rank] = []
    try:
        with _quiet_spawn():
            context = mp.get_context("forkserver")
            context.set_forkserver_preload([*RANK_IMPORTS, target.split(":")[0]])
            for rank in range(tp * pp * cp):
                parent_end, child_end = context.Pipe(duplex=False)
                process = context.Process(target=_rank_main, args=(spec, rank, child_end),
                                          name=f"hicache-rank-{rank}")
                process.start()
                child_end.close()
                ranks.append(_Rank(RankCoords.of(rank, tp, pp, cp), process, parent_end))
                if on_start is not None:
                    on_start(rank, process.pid)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        _collect(ranks, on_progress or (lambda info: None), deadline, deadline_s)
        return [r.result for r in ranks]
    finally:
        _stop(ranks)


def _collect(ranks: list[_Rank], on_progress: Callable[[dict], None],
             deadline: float | None, deadline_s: float | None) -> None:
    by_conn = {r.conn: r for r in ranks}
    by_sentinel = {r.process.sentinel: r for r in ranks}
    while not all(r.done for r in ranks):
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise HiCacheError(f"run did not finish within its deadline of {deadline_s:g} s")
        ready = wait([*by_conn, *by_sentinel], min(left, WAKE_S))
        errors = _take(ranks, ready, by_conn, by_sentinel, on_progress)
        if errors:
            # A peer's error may come a moment before the pipe of the rank whose death caused
            # it closes (its sockets may close first): that death, if any, is the root cause.
            grace_end = time.monotonic() + DEATH_GRACE_S
            while (left := grace_end - time.monotonic()) > 0 and (by_conn or by_sentinel):
                _take(ranks, wait([*by_conn, *by_sentinel], left), by_conn, by_sentinel, on_progress)
            raise errors[0]


def _take(ranks: list[_Rank], ready: list, by_conn: dict[Connection, _Rank], by_sentinel: dict[int, _Rank],
          on_progress: Callable[[dict], None]) -> list[Exception]:
    """Handle what the ranks in `ready` said; raise for a rank that died without reporting (a
    silent death is a root cause: peers' errors in the same batch are its cascade), else return
    the errors reported. A rank's pipe closes as it dies; the fork server reports its exit later."""
    for sentinel in by_sentinel.keys() & set(ready):
        del by_sentinel[sentinel]
    errors = [error for r in ranks if r.conn in ready or r.process.sentinel in ready
              for error in _drain(r, by_conn, on_progress)]
    for rank in ranks:
        if not rank.done and (rank.closed or rank.process.sentinel in ready):
            rank.process.join(STOP_GRACE_S)     # it has exited: reap it for its code
            raise HiCacheError(f"{rank.coords.label()} died without reporting "
                               f"({_exit_reason(rank.process.exitcode)})")
    return errors


def _drain(rank: _Rank, by_conn: dict[Connection, _Rank],
           on_progress: Callable[[dict], None]) -> list[Exception]:
    """Handle every message the rank has sent so far, and return the errors it reported;
    forget its pipe once it is closed."""
    errors = []
    while rank.conn in by_conn and rank.conn.poll():
        try:
            message = json.loads(rank.conn.recv_bytes())
        except EOFError:
            del by_conn[rank.conn]
            rank.closed = True
            break
        kind = message["kind"]
        if kind == "progress":
            on_progress({**message["data"], "rank": rank.coords.rank})
        elif kind == "result":
            rank.result, rank.done = message["data"], True
        else:
            errors.append(error_type(message["type"])(message["message"]))
    return errors


def _stop(ranks: list[_Rank]) -> None:
    """Terminate, then kill after a grace period, and reap every rank process."""
    alive = [r.process for r in ranks if r.process.is_alive()]
    for process in alive:
        process.terminate()
    grace_end = time.monotonic() + STOP_GRACE_S
    for process in alive:
        process.join(max(0.0, grace_end - time.monotonic()))
    for process in alive:
        if process.is_alive():
            process.kill()
            process.join()
    for rank in ranks:
        rank.conn.close()


@contextlib.contextmanager
def _quiet_spawn() -> Iterator[None]:
    """Children start with one OpenMP thread and SIGINT ignored: Ctrl-C is the parent's to handle.

    The fork server starts within it, so it imports torch with one OpenMP thread, and, since an
    ignored signal stays ignored across exec, no child of it prints a KeyboardInterrupt
    traceback. Only the main thread may change the handler; children launched from another
    thread ignore SIGINT from _rank_main on.
    """
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    in_main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
    try:
        yield
    finally:
        if in_main:
            signal.signal(signal.SIGINT, handler)
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _rank_main(spec_text: str, rank: int, conn: Connection) -> None:
    """Entry point of a rank process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(spec_text)
    os.environ.clear()
    os.environ.update(spec["env"])
    _die_with_launcher(spec["parent_pid"])
    coords = RankCoords.of(rank, spec["tp"], spec["pp"], spec["cp"])

    def send(message: dict) -> None:
        conn.send_bytes(json.dumps(message).encode())

    try:
        store = dist.TCPStore("127.0.0.1", spec["store_port"], None, False,
                              timeout=timedelta(seconds=spec["timeout_s"]))
        result = run_target(spec["target"], coords, run_id=spec["run_id"], payload=spec["payload"],
                            timeout_s=spec["timeout_s"], send=send, join={"store": store})
        send({"kind": "result", "data": result})
    except Exception as exc:
        send({"kind": "error", "type": type(exc).__name__, "message": one_line(coords, exc)})
        time.sleep(LINGER_S)
        os._exit(1)


def _die_with_launcher(launcher_pid: int) -> None:
    """SIGKILL this rank as soon as the launching process is gone, however it went. Its parent
    is the fork server, which lives as long as any of its children does, so PR_SET_PDEATHSIG
    cannot say it: a thread waits on the launcher's pidfd instead."""
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([launcher], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="hicache-launcher-watch", daemon=True).start()


def die_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Ask Linux to send this process `sig` when the parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent_pid:
        os._exit(1)
