"""What one simulated rank runs for `replay`: a trace on the replay engine with the HiCache
plugin, every reused page checked against the replay KV function."""
from __future__ import annotations

import resource

from ...config import CacheConfig
from ...engine.kv_witness import KVCheck
from ...engine.replay.clock import ForwardTimer, VirtualClock
from ...engine.replay.model import ReplayModel, ReplayModelSpec, ReplayScheduler
from ...engine.replay.modelled_clock import ModelledClock
from ...engine.replay.trace import read_trace
from ...engine.replay.workload import ReplaySpec, ReplayWorkload
from .harness import hicache_plugin, serve_with_progress, with_telemetry


async def run_rank(ctx) -> dict:
    return await with_telemetry(ctx, _replay)


async def _replay(ctx) -> dict:
    spec = ReplaySpec.from_dict(ctx.payload["replay"])
    cache_cfg = CacheConfig(**ctx.payload["cache"])
    ps = cache_cfg.page_size
    clock = VirtualClock()
    transfers = ModelledClock(clock, spec.hardware, ctx.coords, ps)
    trace = read_trace(spec.trace, ps, spec.limit)
    timer = ForwardTimer(clock, spec.costs, trace, loads=transfers.take_loads_us, layers=spec.hardware.preset.layers)
    model = ReplayModel(ReplayModelSpec(**ctx.payload["model"]), ps, timer, ctx.coords, ctx.groups)
    layout = model.kv_layout(ps)
    check = KVCheck(model.kv, layout, ctx.coords, exact=True)
    workload = ReplayWorkload(trace, spec, ps, clock)
    async with hicache_plugin(ctx, cache_cfg) as plugin:
        scheduler = ReplayScheduler(model, plugin, device_pages=cache_cfg.device_pages, page_size=ps,
                                    run_id=ctx.run_id, witness=check, clock=transfers)
        await serve_with_progress(ctx, lambda on_finish: scheduler.run(workload, on_finish))
    report = plugin.report()
    report.update(check.report())
    report["admission_us"] = scheduler.admission_us.tolist()
    report["requests"] = workload.completed
    report["forwards"] = scheduler.forwards
    report["virtual_seconds"] = round(clock.now_us / 1e6, 3)
    report["ttft_us"] = timer.ttft_us.tolist()
    report["cached_tokens"] = [timer.cached[r.line] for r in trace]     # in the trace's order
    report["last_forward_us"] = timer.last_us
    report["page_bytes"] = layout.page_bytes
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return report
