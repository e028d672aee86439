"""Embed the HiCache plugin in an engine's scheduler loop, on one rank, and watch it reuse KV.

    .venv/bin/python examples/embed_plugin.py

The reference scheduler here calls the plugin the way an engine would: `admit` when a request
arrives, `layer_ready` from the forward pass, `finish` when it is done, and `await on_step()`
once per loop iteration.
"""
import asyncio

from hicache_async import CacheConfig, HiCachePlugin, MemoryStorage
from hicache_async.engine import ModelConfig, Scheduler, TinyModel, Workload, WorkloadSpec


async def main() -> None:
    cache = CacheConfig(device_pages=32, host_pages=64, page_size=16, write_policy="write_through",
                        prefetch_threshold=16)
    plugin = HiCachePlugin(cache, storage=MemoryStorage(), storage_name="memory")
    scheduler = Scheduler(TinyModel(ModelConfig()), plugin, device_pages=cache.device_pages,
                          page_size=cache.page_size)
    workload = Workload(WorkloadSpec(requests=16))
    async with plugin:      # owns the storage workers: none outlives the loop
        # Returns once every request finished and every in-flight transfer retired.
        await scheduler.run(workload, on_finish=lambda req: print(f"request {req.id}: "
                                                                  f"{req.cached} cached prompt tokens"))
    report = plugin.report()
    print({k: v for k, v in report.items() if k.startswith("tokens_") or k == "transfers"})


if __name__ == "__main__":
    asyncio.run(main())
