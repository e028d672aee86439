"""What the scheduler loop gives a KV plugin and asks of it; plugins register by entry point."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from .clock import OpClock
from .errors import UsageError
from .layout import KVLayout
from .pools import DevicePool
from .request import Request
from .topology import RankCoords

GROUP = "hicache_async.plugins"


@dataclass
class EngineContext:
    layout: KVLayout
    device: DevicePool
    coords: RankCoords
    run_id: str = "local"
    groups: Any = None      # ParallelGroups when the engine runs across ranks
    clock: OpClock = field(default_factory=OpClock)   # when ops count as complete: wall time by default


class KVPlugin:
    """The duties a KV plugin has towards the scheduler loop, one method each.

    The engine runs its loop inside `async with plugin:`, so whatever the plugin starts in the
    background ends when the loop does."""

    async def __aenter__(self) -> KVPlugin:
        """Start what the plugin runs beside the loop; `attach` may come before or after."""
        return self

    async def __aexit__(self, *exc_info) -> None:
        """Stop workers, finish what peers wait for, and release resources; awaited, so it
        never blocks the scheduler's event loop. An error from the body propagates as is."""

    def attach(self, engine: EngineContext) -> None:
        """Take the engine's device pool and placement; called once before the loop starts."""

    def admit(self, req: Request) -> bool:
        """Give `req` its device pages (reusing cached prefix KV); False: try again next step."""
        raise NotImplementedError

    def fetching(self, req: Request) -> bool:
        """Whether `req` waits for the plugin's own fetch (an L3 prefetch), so that `admit` only
        marks it wanted and does no cache work: an engine timing admissions leaves it out."""
        return False

    async def layer_ready(self, reqs: list[Request], layer: int) -> None:
        """Return once layer `layer` of every request's cached KV is on the device; called
        from the forward pass with the newly admitted requests that reuse cached KV."""

    def finish(self, req: Request) -> None:
        """The request is done: keep what is worth caching and free the rest."""
        raise NotImplementedError

    def kv_origin(self, req: Request) -> list[str]:
        """The tier ("l1", "l2", "l3") each of `req`'s cached pages came from, for error reports."""
        return []

    def busy(self) -> bool:
        """Whether ops are in flight, i.e. whether a failed admission may succeed later."""
        return False

    async def on_step(self) -> None:
        """Once per loop iteration on every rank: reap, agree, retire."""

    async def wait_progress(self, timeout_s: float) -> None:
        """Called by an idle loop between steps: return once in-flight work may be retired, or
        after `timeout_s` at most. This default, for a plugin that cannot tell, naps briefly."""
        await asyncio.sleep(min(timeout_s, 2e-4))

    def report(self) -> dict:
        return {}


def load_plugin(name: str, **options: Any) -> KVPlugin:
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in found:
        raise UsageError(f"unknown plugin {name!r}: installed are {', '.join(sorted(found))}")
    return found[name].load()(**options)
