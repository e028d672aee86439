"""Helpers shared by tests: run the reference engine with a plugin in this process."""
import asyncio

from hicache_async.engine.model import ModelConfig, TinyModel
from hicache_async.engine.scheduler import Scheduler
from hicache_async.engine.workload import Workload, WorkloadSpec
from hicache_async.plugin import HiCachePlugin
from hicache_async.reference import reference_outputs


def run_cached(plugin: HiCachePlugin, spec: WorkloadSpec, model: ModelConfig) -> dict:
    cfg = plugin.config
    scheduler = Scheduler(TinyModel(model), plugin, device_pages=cfg.device_pages, page_size=cfg.page_size)
    workload = Workload(spec)

    try:
        asyncio.run(scheduler.run(workload))
    finally:
        plugin.close()
    return workload.results()


def assert_matches_reference(plugin, spec, model) -> dict:
    outputs = run_cached(plugin, spec, model)
    assert outputs == reference_outputs(model, spec, plugin.config.page_size)
    return plugin.report()
