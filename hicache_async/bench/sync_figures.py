"""`on_step_tp2pp2_us`: the agreement's per-step cost at tp=2, pp=2, against the raw collectives
it is built from — one gloo MIN all_reduce on stage 0 plus one recv/isend hop — in the same run."""
from __future__ import annotations

import asyncio
import statistics
import time

import torch
import torch.distributed as dist

from ..agreement import pack
from ..pp_sync import SYNC_TAG, PipelineAgreement
from ..ranks.launcher import launch
from .figure import figure


async def _agreement(ctx, steps: int) -> float:
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    start = time.perf_counter()
    for step in range(steps):
        agreement.reap()
        await agreement.agree(pack((0, 0, 0, 0), [], 1), step)
    agreement.close()
    return (time.perf_counter() - start) / steps * 1e6


def _raw(ctx, steps: int) -> float:
    g = ctx.groups
    msg = torch.tensor(pack((0, 0, 0, 0), [], 1))
    sends = []
    start = time.perf_counter()
    for _ in range(steps):
        if g.is_first_stage:
            dist.all_reduce(msg, op=dist.ReduceOp.MIN, group=g.agree)
        else:
            dist.recv(msg, src=g.prev_stage, tag=SYNC_TAG)
        if g.next_stage is not None:
            sends.append(dist.isend(msg.clone(), dst=g.next_stage, tag=SYNC_TAG))
            if len(sends) > 4:
                sends.pop(0).wait()
    for work in sends:
        work.wait()
    return (time.perf_counter() - start) / steps * 1e6


def measure(ctx) -> dict:
    """Rank target: alternate raw and agreement rounds; a barrier separates them."""
    steps, rounds = ctx.payload["steps"], ctx.payload["rounds"]
    raw, agreed = [], []
    for _ in range(rounds):
        dist.barrier()
        raw.append(_raw(ctx, steps))
        dist.barrier()
        agreed.append(asyncio.run(_agreement(ctx, steps)))
    return {"raw": statistics.median(raw), "agreed": statistics.median(agreed)}


def on_step_tp2pp2(steps: int, rounds: int) -> dict:
    results = launch(tp=2, pp=2, cp=1, target="hicache_async.bench.sync_figures:measure",
                     payload={"steps": steps, "rounds": rounds}, timeout_s=60)
    # The last stage sees the whole chain: its per-step time is the step's agreement latency.
    value = max(r["agreed"] for r in results)
    baseline = max(r["raw"] for r in results)
    return figure("on_step_tp2pp2_us", value, "us", "raw_allreduce_plus_hop_us", baseline)

