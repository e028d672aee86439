"""Rank targets for the launcher and torchrun tests (tests/sim/); each runs inside a rank process."""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from hicache_async.errors import UsageError
from hicache_async.parallel.dist_wait import all_reduce
from hicache_async.sim.ranks.launcher import RankContext


def report_groups(ctx: RankContext) -> dict:
    g = ctx.groups

    def members(group):
        return None if group is None else dist.get_process_group_ranks(group)

    ones = torch.ones(1)
    if g.tp is not None:
        dist.all_reduce(ones, group=g.tp)
    return {
        "rank": ctx.coords.rank, "tp": members(g.tp), "cp": members(g.cp),
        "stage": members(g.stage), "agree": members(g.agree), "prev": g.prev_stage,
        "next": g.next_stage, "last_root": g.last_stage_root, "first": g.is_first_stage,
        "last": g.is_last_stage, "tp_sum": int(ones.item()), "run_id": ctx.run_id,
        "payload": ctx.payload,
    }


async def all_reduce_until_killed(ctx: RankContext) -> dict:
    """Report the pid at step 20, then keep reducing; the test kills one rank."""
    for step in range(100_000):
        if step == 20:
            ctx.progress({"pid": os.getpid(), "step": step})
        await all_reduce(torch.ones(1), op=dist.ReduceOp.SUM, group=ctx.groups.world,
                         what=f"step {step} all_reduce", coords=ctx.coords,
                         timeout_s=ctx.timeout_s)
    return {}


async def one_rank_hangs(ctx: RankContext) -> dict:
    ctx.progress({"pid": os.getpid()})
    if ctx.coords.rank == ctx.payload["hang_rank"]:
        time.sleep(ctx.payload["hang_s"])
    await all_reduce(torch.ones(1), op=dist.ReduceOp.MIN, group=ctx.groups.world,
                     what="hang-test all_reduce", coords=ctx.coords, timeout_s=ctx.timeout_s)
    return {}


async def one_rank_misconfigured(ctx: RankContext) -> dict:
    ctx.progress({"pid": os.getpid()})
    if ctx.coords.rank == ctx.payload["bad_rank"]:
        raise UsageError("--device-pages must be > 0, got 0")
    await all_reduce(torch.ones(1), op=dist.ReduceOp.MIN, group=ctx.groups.world,
                     what="usage-test all_reduce", coords=ctx.coords, timeout_s=ctx.timeout_s)
    return {}


def sleep_forever(ctx: RankContext) -> dict:
    ctx.progress({"pid": os.getpid()})
    time.sleep(120)
    return {}


def unserialisable_result(ctx: RankContext) -> dict:
    return {"tensor": torch.ones(1)}


def time_all_reduce(ctx: RankContext) -> dict:
    """Median microseconds of a 1-element MIN all_reduce: blocking vs awaited, interleaved."""
    import asyncio

    n, reps = ctx.payload["n"], ctx.payload["reps"]
    x = torch.ones(1)

    async def awaited() -> float:
        start = time.perf_counter()
        for _ in range(n):
            await all_reduce(x, op=dist.ReduceOp.MIN, group=ctx.groups.world, what="bench",
                             coords=ctx.coords, timeout_s=ctx.timeout_s)
        return (time.perf_counter() - start) / n * 1e6

    def blocking() -> float:
        start = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return (time.perf_counter() - start) / n * 1e6

    blocking()  # warm-up
    times: dict[str, list[float]] = {"blocking_us": [], "awaited_us": []}
    for _ in range(reps):
        times["blocking_us"].append(blocking())
        times["awaited_us"].append(asyncio.run(awaited()))
    return {k: statistics.median(v) for k, v in times.items()}


def read_shipped(ctx: RankContext) -> dict:
    """The file the payload names, as this rank sees it."""
    with open(ctx.payload["file"]) as f:
        return {"path": ctx.payload["file"], "text": f.read(), "seed": ctx.payload["seed"]}
