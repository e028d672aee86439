"""What a rank process does around its target, however it was started (our launcher or torchrun):
join the gloo process group, build the rank's groups, run the target, leave the group.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ... import errors
from ...errors import HiCacheError, UsageError
from ...parallel.groups import ParallelGroups
from ...topology import RankCoords

PG_SLACK_S = 5.0  # gloo's own timeout fires after ours, so the user sees our one-line SyncTimeout


@dataclass
class RankContext:
    """What a target function gets: where it sits, its groups, and the run's parameters."""

    coords: RankCoords
    groups: ParallelGroups
    run_id: str
    payload: dict
    timeout_s: float
    send: Callable[[dict], None] = field(default=lambda message: None, repr=False)

    def progress(self, info: dict) -> None:
        """Forward `info` (JSON-serialisable) to the launcher's on_progress, tagged with this rank."""
        self.send({"kind": "progress", "data": info})


def run_target(target: str, coords: RankCoords, *, run_id: str, payload: dict, timeout_s: float,
               send: Callable[[dict], None], join: Mapping[str, Any]) -> dict:
    """Run `target(ctx)` ("package.module:function", sync or async) as this rank; its JSON result.

    `join` holds init_process_group's rendezvous arguments: `init_method` or `store`.
    """
    torch.set_num_threads(1)
    function = import_target(target)
    dist.init_process_group("gloo", world_size=coords.world_size, rank=coords.rank,
                            timeout=timedelta(seconds=timeout_s + PG_SLACK_S), **join)
    ctx = RankContext(coords, ParallelGroups.build(coords), run_id, payload, timeout_s, send)
    result = function(ctx)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    json.dumps(result)  # fail here, on this rank, if the result cannot travel
    dist.barrier()  # gloo's barrier also flushes this rank's pending sends before teardown
    dist.destroy_process_group()
    return {} if result is None else result


def import_target(target: str) -> Callable[[RankContext], Any]:
    module_name, _, function_name = target.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError, ValueError):
        raise UsageError(f"rank target {target!r} is not an importable 'module:function'") from None
    if not callable(function):
        raise UsageError(f"rank target {target!r} is not callable")
    return function


def one_line(coords: RankCoords, exc: Exception) -> str:
    """'{rank label}: {message}'; errors outside our hierarchy also name their class and place."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if not isinstance(exc, HiCacheError):
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            text += f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
        text = f"{type(exc).__name__}: {text}"
    return text if text.startswith(coords.label()) else f"{coords.label()}: {text}"


def error_type(name: str) -> type[HiCacheError]:
    """Our error class called `name`, so a rank's error keeps its type (and exit code) elsewhere."""
    error = getattr(errors, name, None)
    return error if isinstance(error, type) and issubclass(error, HiCacheError) else HiCacheError
