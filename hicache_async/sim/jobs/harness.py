"""The run harness every job shares: on the launching side, the run's arguments, its storage
session, its ranks (our launcher or torchrun) and the figures every job reports from them;
inside a rank, its telemetry, the HiCache plugin over the run's storage, and progress.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from tqdm import tqdm

from ...api import KVPlugin, load_plugin
from ...config import CacheConfig
from ...errors import StorageError, UsageError
from ...parallel.agreement import LocalAgreement
from ...parallel.pp_sync import PipelineAgreement
from ...request import Request
from ...storage.base import DEFAULT_STORAGE, storage_backend
from ...telemetry.sdk import setup_telemetry
from ...telemetry.trace_file import merge_trace_files, part_path
from ...transfer.l3_session import open_adapter
from ..ranks import torchrun
from ..ranks.launcher import launch

TOKEN_FIELDS = ("tokens_from_l1", "tokens_from_l2", "tokens_from_l3", "tokens_computed")
# the last: staging and host pages held at the end by calls given up on
STORAGE_COUNTS = ("storage_errors", "corrupt_objects", "forged_objects", "missing_objects", "healed_objects",
                  "l3_bytes_written", "l3_bytes_read", "quarantined_bytes")


@dataclass
class RunArgs:
    """Topology, storage and telemetry of a run on simulated ranks: `simulate` and `replay`."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    storage: str = DEFAULT_STORAGE
    storage_options: dict = field(default_factory=dict)   # the backend's own flags, by dest
    l3_capacity: int | None = None     # bytes; only backends that take a capacity
    timeout_s: float = 60.0
    trace_file: str | None = None
    log_json: bool = False
    storage_optional: bool = False
    storage_secret_file: str | None = None   # seal every stored object with the key derived from it


def launch_ranks(args: RunArgs, target: str, payload: dict, requests: int, job: str,
                 scratch: str | None = None) -> tuple[list[dict], str, float]:
    """Run `target` on every rank with a progress bar over `requests`; (reports, run id, seconds).

    Our launcher starts the ranks, or, under torchrun, this process is rank 0 of those it
    started; `scratch` is a directory the payload names files in, sent to every rank.
    Adds the telemetry settings to `payload` and merges the ranks' span files afterwards.
    """
    payload = {**payload, "trace_file": args.trace_file, "log_json": args.log_json}
    run_id = uuid.uuid4().hex[:16]
    started = time.perf_counter()
    with tqdm(total=requests, desc=f"{job} tp{args.tp} pp{args.pp} cp{args.cp}",
              unit="req", file=sys.stderr, disable=None) as bar:
        ranks = dict(tp=args.tp, pp=args.pp, cp=args.cp, target=target, payload=payload, run_id=run_id,
                     timeout_s=args.timeout_s, on_progress=lambda info: bar.update(info["requests_done"] - bar.n))
        reports = torchrun.lead(**ranks, scratch=scratch) if torchrun.environment() else launch(**ranks)
    seconds = time.perf_counter() - started
    if args.trace_file:
        world = args.tp * args.pp * args.cp
        merge_trace_files([part_path(args.trace_file, r) for r in range(world)], args.trace_file)
    return reports, run_id, seconds


@contextlib.contextmanager
def storage_spec(args: RunArgs, cold: bool = False):
    """The storage every rank opens ({"name", "options"}, or None for no L3), set up once for
    the run by the backend's own session (`StorageAdapter.open_session`). `cold`: the run
    wants an L3 that starts empty unless the backend's options name a shared one."""
    backend = None if args.storage == "none" else storage_backend(args.storage)
    if args.storage_secret_file and backend is None:
        raise UsageError(f"--storage-secret-file {args.storage_secret_file} needs a storage to seal")
    if args.l3_capacity is not None and not (backend and backend.takes_capacity):
        raise UsageError(f"--l3-capacity {args.l3_capacity}: the {args.storage} storage has no capacity "
                         f"to bound")
    if backend is None:
        yield None
        return
    with contextlib.ExitStack() as stack:
        try:
            options = stack.enter_context(backend.open_session(
                args.storage_options, capacity_bytes=args.l3_capacity, cold=cold))
        except StorageError as exc:
            if not args.storage_optional:
                raise
            print(f"hicache-async: warning: {exc}; running on L1/L2 only (--storage-optional)", file=sys.stderr)
            options = None
        if options is None:
            yield None
        else:   # the secret's path, never the secret: each rank reads it itself
            yield {"name": args.storage, "options": options, "secret_file": args.storage_secret_file}


def rank_figures(args: RunArgs, reports: list[dict], run_id: str, seconds: float, storage_used: str) -> dict:
    """What every run reports from its ranks' reports: topology, tiers, KV checks, agreement,
    step times, transfers and storage counters."""
    first = reports[0]
    # The cache decisions (digest, transfers) are each rank's own and must agree.
    ranks_agree = all(r["digest"] == first["digest"] and r["transfers"] == first["transfers"]
                      for r in reports)
    mismatch = next((r["kv_first_mismatch"] for r in reports if r["kv_first_mismatch"]), None)
    step_p50, step_p99 = p50_p99([us for r in reports for us in r["step_us"]])
    out = {
        "world_size": args.tp * args.pp * args.cp, "tp": args.tp, "pp": args.pp, "cp": args.cp,
        "storage": args.storage, "storage_used": storage_used,
        "storage_sealed": storage_used != "none" and args.storage_secret_file is not None, "run_id": run_id,
        "prompt_tokens": first["prompt_tokens"],
        **{k: first[k] for k in TOKEN_FIELDS},
        "ranks_agree": ranks_agree,
        "kv_verified_pages": sum(r["kv_verified_pages"] for r in reports),
        "kv_mismatches": sum(r["kv_mismatches"] for r in reports),
        "kv_first_mismatch": mismatch,
        "steps": first["steps"], "forwards": first["forwards"],
        "on_step_us_p50": step_p50, "on_step_us_p99": step_p99,
        "transfers": first["transfers"],
        **{k: sum(r[k] for r in reports) for k in STORAGE_COUNTS},
        "dropped_pages": first["dropped_pages"],
        "most_pending_sends": max(r["most_pending_sends"] for r in reports),
        "seconds": round(seconds, 2),
    }
    total = max(1, out["prompt_tokens"])
    out["tiers"] = {k.removeprefix("tokens_").removeprefix("from_"): {
        "tokens": out[k], "share": round(out[k] / total, 4)} for k in TOKEN_FIELDS}
    return out


def p50_p99(values: list[float]) -> tuple[float, float]:
    """Median and 99th percentile, rounded to 0.1; zeros for fewer than two values."""
    cuts = statistics.quantiles(values, n=100) if len(values) > 1 else [0.0] * 99
    return round(cuts[49], 1), round(cuts[98], 1)


# -- inside a rank --------------------------------------------------------------------------

async def with_telemetry(ctx, body: Callable[[Any], Awaitable[dict]]) -> dict:
    """`await body(ctx)` with this rank's telemetry set up as the payload asks, flushed after."""
    trace_file = ctx.payload.get("trace_file")
    telemetry = setup_telemetry(coords=ctx.coords, run_id=ctx.run_id, log_json=ctx.payload.get("log_json", False),
                                trace_file=part_path(trace_file, ctx.coords.rank) if trace_file else None)
    try:
        return await body(ctx)
    finally:
        telemetry.shutdown()


@contextlib.asynccontextmanager
async def hicache_plugin(ctx, cache_cfg: CacheConfig) -> AsyncIterator[KVPlugin]:
    """The HiCache plugin over the payload's storage and this rank's agreement, entered; on
    exit the plugin is exited, then the storage it used closed."""
    storage_spec = ctx.payload.get("storage")
    storage = (open_adapter(storage_spec["name"], storage_spec["options"], storage_spec.get("secret_file"))
               if storage_spec else None)
    try:
        agreement = (LocalAgreement() if ctx.coords.world_size == 1
                     else PipelineAgreement(ctx.coords, ctx.groups, cache_cfg.sync_timeout_s))
        plugin = load_plugin("hicache", config=cache_cfg, storage=storage, agreement=agreement,
                             storage_name=storage_spec["name"] if storage_spec else "none")
        async with plugin:
            yield plugin
    finally:
        if storage is not None:     # may wait for a call stuck in a dead backend: off the loop
            await anyio.to_thread.run_sync(storage.close)


PROGRESS_EVERY_S = 0.1


async def serve_with_progress(ctx, serve: Callable[[Callable[[Request], None]], Awaitable[None]]) -> None:
    """`await serve(on_finish)`, the rank's scheduler loop, while rank 0 reports its count of
    finished requests at most every PROGRESS_EVERY_S (a pipe write or a progress bar: kept off
    the per-request path). Both run in one task group, so the reporter ends with the loop; an
    error from the loop propagates as it was, not wrapped in an exception group."""
    done = sent = 0

    def on_finish(_req: Request) -> None:
        nonlocal done
        done += 1

    def flush() -> None:
        nonlocal sent
        if done != sent and ctx.coords.rank == 0:
            sent = done
            ctx.progress({"requests_done": done})

    async def report() -> None:
        while True:
            await anyio.sleep(PROGRESS_EVERY_S)
            flush()

    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(report)
        try:
            await serve(on_finish)
        except Exception as exc:
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    flush()
