"""What one simulated rank runs: the reference engine with the HiCache plugin on a workload."""
from __future__ import annotations

import dataclasses
import logging

from ...config import CacheConfig
from ...engine.kv_witness import KVCheck
from ...engine.scheduler import Scheduler
from ...engine.tiny.kv_record import RecordedKV
from ...engine.tiny.model import ModelConfig, TinyModel
from ...engine.tiny.workload import Workload, WorkloadSpec
from .harness import hicache_plugin, serve_with_progress, with_telemetry

log = logging.getLogger(__name__)


def specs_from(payload: dict) -> tuple[ModelConfig, CacheConfig, WorkloadSpec]:
    spec = dict(payload["workload"])
    spec["user_len"] = tuple(spec["user_len"])
    return ModelConfig(**payload["model"]), CacheConfig(**payload["cache"]), WorkloadSpec(**spec)


def payload_of(model: ModelConfig, cache: CacheConfig, workload: WorkloadSpec, storage: dict | None) -> dict:
    return {"model": dataclasses.asdict(model), "cache": dataclasses.asdict(cache),
            "workload": dataclasses.asdict(workload), "storage": storage}


async def run_rank(ctx) -> dict:
    return await with_telemetry(ctx, _run)


def _kv_check(ctx, model: TinyModel, page_size: int) -> KVCheck | None:
    """Checks cached pages against the reference run's recorded KV, when the payload names it."""
    path = ctx.payload.get("kv_reference")
    if not path:
        return None
    layout = model.kv_layout(page_size)
    truth = RecordedKV(path, layout)
    return KVCheck(truth, layout, ctx.coords, exact=False)


async def _run(ctx) -> dict:
    model_cfg, cache_cfg, spec = specs_from(ctx.payload)
    async with hicache_plugin(ctx, cache_cfg) as plugin:
        model = TinyModel(model_cfg, ctx.coords, ctx.groups if ctx.coords.world_size > 1 else None,
                          timeout_s=cache_cfg.sync_timeout_s)
        check = _kv_check(ctx, model, cache_cfg.page_size)
        scheduler = Scheduler(model, plugin, device_pages=cache_cfg.device_pages,
                              page_size=cache_cfg.page_size, run_id=ctx.run_id, witness=check)
        workload = Workload(spec)
        log.debug("rank started: %s, storage %s, key scheme %s", model_cfg.attention,
                  plugin.storage_name, cache_cfg.key_scheme)
        await serve_with_progress(ctx, lambda on_finish: scheduler.run(workload, on_finish))
    report = plugin.report()
    log.debug("rank finished: %d steps, tokens l1 %d l2 %d l3 %d computed %d, storage errors %d",
             report["steps"], report["tokens_from_l1"], report["tokens_from_l2"],
             report["tokens_from_l3"], report["tokens_computed"], report["storage_errors"])
    if check is not None:
        report.update(check.report())
    report["outputs"] = workload.results()
    report["forwards"] = scheduler.forwards
    return report
