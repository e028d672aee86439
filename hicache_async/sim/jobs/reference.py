"""The cache-less single-rank run that every cached run is compared against: its tokens, and
the KV it computed for every prompt page (see `engine.kv_record`)."""
from __future__ import annotations

import asyncio

from ...api import load_plugin
from ...engine.scheduler import Scheduler
from ...engine.tiny.kv_record import KVRecorder
from ...engine.tiny.model import ModelConfig, TinyModel
from ...engine.tiny.workload import Workload, WorkloadSpec


def reference_run(model_cfg: ModelConfig, spec: WorkloadSpec, page_size: int
                  ) -> tuple[dict[str, list[int]], KVRecorder]:
    """Generated tokens per "conversation:turn", and the recorded KV."""
    pages_per_request = -(-(spec.max_prompt() + spec.max_new) // page_size)
    recorder = KVRecorder(page_size)
    scheduler = Scheduler(TinyModel(model_cfg), load_plugin("none"), page_size=page_size,
                          device_pages=pages_per_request * spec.concurrency, witness=recorder)
    workload = Workload(spec)
    asyncio.run(scheduler.run(workload))
    return workload.results(), recorder
