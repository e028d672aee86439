"""Helpers shared by tests: run the reference engine with a plugin in this process."""
import asyncio

from hicache_async.engine.kv_witness import KVCheck
from hicache_async.engine.scheduler import Scheduler
from hicache_async.engine.tiny.kv_record import RecordedKV
from hicache_async.engine.tiny.model import ModelConfig, TinyModel
from hicache_async.engine.tiny.workload import Workload, WorkloadSpec
from hicache_async.hicache.plugin import HiCachePlugin
from tests.helpers.reference_kv import reference

# Pools small enough that KV comes back from L3: the workload of the L3 tests.
L3_WORKLOAD = WorkloadSpec(requests=24, turns=4, system_prompts=2, system_len=32, user_len=(8, 16), max_new=4,
                           concurrency=6)


def run_cached(plugin: HiCachePlugin, spec: WorkloadSpec, model: ModelConfig,
               check: KVCheck | None = None) -> dict:
    cfg = plugin.config
    scheduler = Scheduler(TinyModel(model), plugin, device_pages=cfg.device_pages, page_size=cfg.page_size,
                          witness=check)
    workload = Workload(spec)

    async def run() -> None:
        async with plugin:
            await scheduler.run(workload)

    asyncio.run(run())
    return workload.results()


def assert_matches_reference(plugin, spec, model) -> dict:
    """Tokens equal the reference and every cached page equals the reference's KV."""
    ps = plugin.config.page_size
    outputs, path = reference(model, spec, ps)
    layout = TinyModel(model).kv_layout(ps)
    check = KVCheck(RecordedKV(path, layout), layout, exact=False)
    assert run_cached(plugin, spec, model, check) == outputs
    assert check.mismatches == 0, check.first_mismatch
    assert check.verified_pages > 0
    return {**plugin.report(), **check.report()}
