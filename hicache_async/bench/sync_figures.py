"""`on_step_tp2pp2_us`: the agreement's per-step cost at tp=2, pp=2, against the raw collectives
it is built from — one gloo MIN all_reduce on stage 0 plus one recv/isend hop — in the same run.

Four ranks share two cores here, so scheduling noise swings whole runs by 2-4x. The two are
therefore interleaved in short blocks inside one event loop, and their totals compared.
"""
from __future__ import annotations

import asyncio
import time

import torch
import torch.distributed as dist

from ..agreement import pack
from ..pp_sync import SYNC_TAG, PipelineAgreement
from ..ranks.launcher import launch
from .figure import figure


async def _agreement(agreement: PipelineAgreement, steps: int, first: int) -> float:
    start = time.perf_counter()
    for step in range(first, first + steps):
        agreement.reap()
        await agreement.agree(pack((0, 0, 0, 0), [], 1), step)
    return time.perf_counter() - start


def _raw(groups, steps: int) -> float:
    msg = torch.tensor(pack((0, 0, 0, 0), [], 1))
    sends = []
    start = time.perf_counter()
    for _ in range(steps):
        if groups.is_first_stage:
            dist.all_reduce(msg, op=dist.ReduceOp.MIN, group=groups.agree)
        else:
            dist.recv(msg, src=groups.prev_stage, tag=SYNC_TAG)
        if groups.next_stage is not None:
            sends.append(dist.isend(msg.clone(), dst=groups.next_stage, tag=SYNC_TAG))
            if len(sends) > 4:
                sends.pop(0).wait()
    for work in sends:
        work.wait()
    return time.perf_counter() - start


async def _interleaved(ctx, blocks: int, steps: int) -> dict:
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    raw = agreed = 0.0
    for block in range(blocks + 1):
        r = _raw(ctx.groups, steps)
        a = await _agreement(agreement, steps, block * steps)
        if block:                      # block 0 warms both up
            raw, agreed = raw + r, agreed + a
    agreement.close()
    n = blocks * steps
    return {"raw": raw / n * 1e6, "agreed": agreed / n * 1e6}


def measure(ctx) -> dict:
    return asyncio.run(_interleaved(ctx, ctx.payload["blocks"], ctx.payload["steps"]))


def on_step_tp2pp2(blocks: int, steps: int) -> dict:
    results = launch(tp=2, pp=2, cp=1, target="hicache_async.bench.sync_figures:measure",
                     payload={"blocks": blocks, "steps": steps}, timeout_s=60)
    # The last stage sees the whole chain: its per-step time is the step's agreement latency.
    value = max(r["agreed"] for r in results)
    baseline = max(r["raw"] for r in results)
    return figure("on_step_tp2pp2_us", value, "us", "raw_allreduce_plus_hop_us", baseline)
