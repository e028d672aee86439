"""The cache-less single-rank run that every cached run's tokens are compared against."""
from __future__ import annotations

import asyncio

from .engine.model import ModelConfig, TinyModel
from .engine.scheduler import Scheduler
from .engine.workload import Workload, WorkloadSpec
from .plugin_api import load_plugin


def reference_outputs(model_cfg: ModelConfig, spec: WorkloadSpec, page_size: int) -> dict[str, list[int]]:
    pages_per_request = -(-(spec.max_prompt() + spec.max_new) // page_size)
    scheduler = Scheduler(TinyModel(model_cfg), load_plugin("none"), page_size=page_size,
                          device_pages=pages_per_request * spec.concurrency)
    workload = Workload(spec)
    asyncio.run(scheduler.run(workload))
    return workload.results()
