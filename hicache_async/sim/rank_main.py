"""What one simulated rank runs: the reference engine with the HiCache plugin on a workload."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from ..api import KVPlugin, load_plugin
from ..config import CacheConfig
from ..engine.kv_record import RecordedKV
from ..engine.kv_witness import KVCheck
from ..engine.model import ModelConfig, TinyModel
from ..engine.scheduler import Scheduler
from ..engine.workload import Workload, WorkloadSpec
from ..parallel.agreement import LocalAgreement
from ..parallel.pp_sync import PipelineAgreement
from ..request import Request
from ..storage.base import open_storage
from ..storage.sealed import SealedStorage, load_key
from ..telemetry.sdk import setup_telemetry
from ..telemetry.trace_file import part_path

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


async def with_telemetry(ctx, body: Callable[[Any], Awaitable[dict]]) -> dict:
    """`await body(ctx)` with this rank's telemetry set up as the payload asks, flushed after."""
    trace_file = ctx.payload.get("trace_file")
    telemetry = setup_telemetry(coords=ctx.coords, run_id=ctx.run_id, log_json=ctx.payload.get("log_json", False),
                                trace_file=part_path(trace_file, ctx.coords.rank) if trace_file else None)
    try:
        return await body(ctx)
    finally:
        telemetry.shutdown()


def _kv_check(ctx, model: TinyModel, page_size: int) -> KVCheck | None:
    """Checks cached pages against the reference run's recorded KV, when the payload names it."""
    path = ctx.payload.get("kv_reference")
    if not path:
        return None
    layout = model.kv_layout(page_size)
    truth = RecordedKV(path, layout)
    return KVCheck(truth.expected, layout, ctx.coords, exact=False)


@contextlib.asynccontextmanager
async def hicache_plugin(ctx, cache_cfg: CacheConfig) -> AsyncIterator[KVPlugin]:
    """The HiCache plugin over the payload's storage and this rank's agreement, entered; on
    exit the plugin is exited, then the storage it used closed."""
    storage_spec = ctx.payload.get("storage")
    storage = open_storage(storage_spec["name"], **storage_spec["options"]) if storage_spec else None
    try:
        if storage_spec and storage_spec.get("secret_file"):
            storage = SealedStorage(storage, load_key(storage_spec["secret_file"]))
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
