"""Ranks that torchrun launched: this process is one rank, and rank 0 leads.

torchrun (or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)
starts every process with the same command line. Rank 0 does what our launcher's parent does:
it prepares each run (the cache-less reference, the storage), runs its own rank, reports, and
decides the exit code. It hands each run, then the exit code, to the other ranks through the
rendezvous store (torch's TCPStore at MASTER_ADDR:MASTER_PORT), and they hand their reports
back the same way: JSON and raw file bytes, never pickle. The store rather than a collective,
because rank 0's preparation may take longer than any collective is allowed to.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ...errors import HiCacheError, SyncTimeout, UsageError
from ...topology import RankCoords
from .target import error_type, one_line, run_target

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
HANDOFF_TIMEOUT_S = 900.0  # how long the other ranks wait for rank 0 to prepare the next run
ACK_TIMEOUT_S = 10.0       # how long a rank 0 that hosts the store waits for the others to read it

_handoffs = itertools.count()  # rank 0's messages, numbered; the other ranks read them in order
_failed_runs: set[int] = set()  # on rank 0: runs whose ranks are stopping, not reading messages


@dataclass(frozen=True)
class Torchrun:
    rank: int
    world_size: int


def environment() -> Torchrun | None:
    """This process's place when torchrun started it; None when the variables are not all set."""
    if not all(name in os.environ for name in ENV):
        return None
    try:
        return Torchrun(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    except ValueError:
        raise UsageError(f"RANK={os.environ['RANK']!r} and WORLD_SIZE={os.environ['WORLD_SIZE']!r} "
                         f"must be integers") from None


def check_world(tp: int, pp: int, cp: int) -> None:
    """Under torchrun, the topology must have exactly one rank per process."""
    env = environment()
    if env is not None and env.world_size != tp * pp * cp:
        raise UsageError(f"--tp {tp} x --pp {pp} x --cp {cp} is {tp * pp * cp} ranks, but torchrun "
                         f"started WORLD_SIZE={env.world_size} processes")


def lead_or_follow(job: Callable[[], int]) -> int:
    """Run `job` (a CLI command) here, or as rank 0 of torchrun's ranks, or follow rank 0.

    Ranks other than 0 print nothing of their own on success and exit with rank 0's code.
    """
    env = environment()
    if env is None:
        return job()
    if env.rank != 0:
        return _follow(env)
    code = 1
    try:
        code = job()
        return code
    except UsageError:
        code = 2
        raise
    finally:
        _handoff({"exit": code})
        if _hosts_store() and not _failed_runs:  # the others still have to read it
            _await(_store(), [f"ack/{r}" for r in range(1, env.world_size)], ACK_TIMEOUT_S,
                   "every rank reading the exit code")


def lead(*, tp: int, pp: int, cp: int, target: str, payload: dict, run_id: str, timeout_s: float,
         on_progress: Callable[[dict], None], scratch: str | None = None) -> list[dict]:
    """Run `target` on every rank, this one as rank 0; the reports in rank order.

    The files in `scratch` travel with the run: payload strings naming a path in it name the
    receiving rank's copy, so ranks on other machines need no shared file system.
    """
    store = _store()
    names = sorted(os.listdir(scratch)) if scratch else []
    k = _handoff({"run": {"tp": tp, "pp": pp, "cp": cp, "target": target, "payload": payload,
                          "run_id": run_id, "timeout_s": timeout_s, "scratch": scratch,
                          "files": names}},
                 {f"file/{name}": _read(os.path.join(scratch, name)) for name in names})
    coords = RankCoords.of(0, tp, pp, cp)

    def send(message: dict) -> None:
        if message["kind"] == "progress":
            on_progress({**message["data"], "rank": 0})

    try:
        report = run_target(target, coords, run_id=run_id, payload=payload, timeout_s=timeout_s,
                            send=send, join={"store": dist.PrefixStore(f"run{k}/pg", store)})
    except Exception as exc:
        _failed_runs.add(k)
        if not _first_failure(store, k):
            raise SystemExit(1) from None  # a cascade: the rank that failed first has said why
        raise error_type(type(exc).__name__)(one_line(coords, exc)) from exc
    keys = [f"run{k}/report/{r}" for r in range(1, coords.world_size)]
    _await(store, keys, timeout_s, "the other ranks' reports")
    return [report, *(json.loads(store.get(key)) for key in keys)]


def _follow(env: Torchrun) -> int:
    """Run each run rank 0 hands over until it hands over its exit code; return that code."""
    store = _store()
    for k in itertools.count():
        _await(store, [f"msg/{k}"], HANDOFF_TIMEOUT_S, "rank 0 handing over the run")
        message = json.loads(store.get(f"msg/{k}"))
        if "exit" in message:
            store.set(f"ack/{env.rank}", b"1")
            return message["exit"]
        _run_handed(store, k, env.rank, message["run"])


def _run_handed(store: dist.Store, k: int, rank: int, run: dict) -> None:
    """Run this rank of run `k` and hand its report to rank 0; a failure ends the process."""
    coords = RankCoords.of(rank, run["tp"], run["pp"], run["cp"])
    failure = None
    with tempfile.TemporaryDirectory(prefix="hicache-run-") as scratch:
        for name in run["files"]:
            with open(os.path.join(scratch, name), "wb") as f:
                f.write(store.get(f"msg/{k}/file/{name}"))
        payload = _relocate(run["payload"], run["scratch"], scratch)
        try:
            report = run_target(run["target"], coords, run_id=run["run_id"], payload=payload,
                                timeout_s=run["timeout_s"], send=lambda message: None,
                                join={"store": dist.PrefixStore(f"run{k}/pg", store)})
        except Exception as exc:
            failure = exc
    if failure is None:
        store.set(f"run{k}/report/{rank}", json.dumps(report).encode())
        return
    if _first_failure(store, k):
        print(f"hicache-async: error: {one_line(coords, failure)}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not a normal exit: gloo work left pending by the failure could block interpreter teardown.
    os._exit(2 if isinstance(failure, UsageError) else 1)


@functools.cache
def _store() -> dist.Store:
    """This process's client of the rendezvous store (rank 0 hosts it when torchrun's agent does
    not), opened once: every run and every message shares it under its own prefix."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=HANDOFF_TIMEOUT_S)))
    return dist.PrefixStore("hicache-async", store)


def _hosts_store() -> bool:
    """torch's env:// rule: rank 0 hosts the store unless torchrun's agent does (its default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _handoff(message: dict, files: dict[str, bytes] | None = None) -> int:
    """Publish rank 0's next message (and its files first); its number."""
    store = _store()
    k = next(_handoffs)
    for key, data in (files or {}).items():
        store.set(f"msg/{k}/{key}", data)
    store.set(f"msg/{k}", json.dumps(message).encode())
    return k


def _await(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> None:
    if not keys:
        return
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistError as exc:
        if isinstance(exc, dist.DistStoreError) and "timeout" in str(exc):
            raise SyncTimeout(f"rank {os.environ['RANK']}: {what} did not happen within "
                              f"{timeout_s:g} s") from None
        raise HiCacheError(f"rank {os.environ['RANK']}: {what} failed: the rendezvous store at "
                           f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} is gone") from None


def _first_failure(store: dist.Store, k: int) -> bool:
    """Whether this rank is the first of run `k` to fail: it says why, later ones are its
    cascade (peers of a rank that exited see their collectives fail) and stay quiet."""
    try:
        return store.add(f"run{k}/failures", 1) == 1
    except dist.DistError:
        return True


def _relocate(payload: dict, old: str | None, new: str) -> dict:
    """`payload` with its top-level paths inside rank 0's scratch directory `old` moved to `new`."""
    if not old:
        return payload
    return {key: new + value[len(old):] if isinstance(value, str) and value.startswith(old + os.sep)
            else value for key, value in payload.items()}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
