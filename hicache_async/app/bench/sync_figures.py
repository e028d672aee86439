"""`on_step_tp2pp2_us`: an idle `HiCachePlugin.on_step` on each of 4 gloo ranks (tp=2, pp=2),
against the raw collectives the step is built from — one gloo MIN all_reduce on stage 0 plus
one recv/isend hop — in the same run.

Idle means nothing is pending, so the step is reap, agree and retire nothing: the per-step
price every rank pays, with no collective beyond the baseline's (`extra_collectives` counts
the world reductions that pending storage ops would add; idle, it must be 0). Four ranks
share two cores here, so scheduling noise swings whole runs by 2-4x. The two are therefore
interleaved in short blocks inside one event loop, and their totals compared.
"""
from __future__ import annotations

import asyncio
import time

import torch
import torch.distributed as dist

from ...api import EngineContext
from ...config import CacheConfig
from ...hicache.ledger import StepMessage
from ...hicache.plugin import HiCachePlugin
from ...layout import KVLayout
from ...parallel.pp_sync import SYNC_TAG, PipelineAgreement
from ...pools import DevicePool
from ...sim.ranks.launcher import launch
from .figure import figure


def _plugin(ctx) -> HiCachePlugin:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=16)
    config = CacheConfig(device_pages=8, host_pages=8)
    plugin = HiCachePlugin(config, agreement=PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s))
    plugin.attach(EngineContext(layout, DevicePool(layout, 8), ctx.coords, groups=ctx.groups))
    return plugin


async def _on_step(plugin: HiCachePlugin, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        await plugin.on_step()
    return time.perf_counter() - start


def _raw(groups, steps: int) -> float:
    msg = torch.tensor([*StepMessage().pack(), 1, -1])
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
    raw = stepped = 0.0
    async with _plugin(ctx) as plugin:
        for block in range(blocks + 1):
            r = _raw(ctx.groups, steps)
            s = await _on_step(plugin, steps)
            if block:                      # block 0 warms both up
                raw, stepped = raw + r, stepped + s
    n = blocks * steps
    return {"raw": raw / n * 1e6, "on_step": stepped / n * 1e6,
            "world_reductions": plugin.agreement.world_reductions}


def measure(ctx) -> dict:
    return asyncio.run(_interleaved(ctx, ctx.payload["blocks"], ctx.payload["steps"]))


def on_step_tp2pp2(blocks: int, steps: int) -> dict:
    results = launch(tp=2, pp=2, cp=1, target="hicache_async.app.bench.sync_figures:measure",
                     payload={"blocks": blocks, "steps": steps}, timeout_s=60)
    # The last stage sees the whole chain: its per-step time is the step's latency.
    value = max(r["on_step"] for r in results)
    baseline = max(r["raw"] for r in results)
    result = figure("on_step_tp2pp2_us", value, "us", "raw_allreduce_plus_hop_us", baseline)
    result["extra_collectives"] = sum(r["world_reductions"] for r in results)   # idle: must be 0
    return result
