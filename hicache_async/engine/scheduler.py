"""The reference engine's event-driven scheduler loop, hosting one KV plugin.

Each iteration: `await plugin.on_step()`, admit arrivals in FIFO order, run one batch
(prefill for newly admitted requests, one decode token for the rest), finish requests.
Every decision depends only on the workload and the plugin's state, so every rank
builds the same batches. The caller runs it inside `async with plugin:`.
"""
from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable

import anyio

from ..api import EngineContext, KVPlugin
from ..clock import OpClock
from ..errors import PoolExhausted
from ..pools import DevicePool
from ..request import Request
from .kv_witness import KVWitness
from .tiny.model import SeqChunk, TinyModel
from .tiny.workload import Workload

IDLE_WAIT_S = 0.05   # the longest an idle rank waits for a completion before stepping anyway


class Scheduler:
    def __init__(self, model: TinyModel, plugin: KVPlugin, *, device_pages: int, page_size: int,
                 run_id: str = "local", witness: KVWitness | None = None, clock: OpClock | None = None) -> None:
        self.model, self.plugin = model, plugin
        self.witness = witness or KVWitness()
        layout = model.kv_layout(page_size)
        self.pool = DevicePool(layout, device_pages)
        self.context = EngineContext(layout, self.pool, model.coords, run_id, model.groups, clock or OpClock())
        plugin.attach(self.context)
        self.forwards = 0
        self.admission_us = array("d")     # each admission attempt's time in the plugin

    async def run(self, workload: Workload, on_finish: Callable[[Request], None] | None = None) -> None:
        """Serve the whole workload, then keep stepping until the plugin's in-flight ops retired
        (the same number of steps on every rank, since `busy()` agrees everywhere)."""
        await self._serve(workload, on_finish)
        while self.plugin.busy():
            await self.plugin.on_step()
            await self.idle(workload)

    async def _serve(self, workload: Workload, on_finish: Callable[[Request], None] | None) -> None:
        waiting: deque[Request] = deque()
        running: list[Request] = []
        plugin = self.plugin
        while not workload.done:
            await plugin.on_step()
            waiting.extend(workload.arrivals())
            admitted: list[Request] = []
            while waiting and self._admit(waiting[0]):
                admitted.append(waiting.popleft())
            if not running and not admitted:
                if waiting and not plugin.busy():
                    raise PoolExhausted(f"request {waiting[0].id} cannot be admitted and nothing is in "
                                        f"flight: the device pool ({self.pool.num_pages} pages) is too small")
                await self.idle(workload)   # until copy or storage work completes
                continue
            running += admitted
            batch = [self.chunk(r) for r in running]
            tokens = await self.model.forward(batch, self.pool.tensor, self._layer_ready(admitted))
            self.forwards += 1
            for req in admitted:
                self.witness.after_prefill(req, self.pool.tensor)
            still = []
            for req, chunk, token in zip(running, batch, tokens):
                req.kv_len = chunk.end
                req.output.append(token)
                if len(req.output) >= req.max_new:
                    plugin.finish(req)
                    workload.complete(req)
                    if on_finish is not None:
                        on_finish(req)
                else:
                    still.append(req)
            running = still

    async def idle(self, workload: Workload) -> None:
        """Nothing can run: wait for in-flight work (an engine on modelled time skips ahead)."""
        await self.plugin.wait_progress(IDLE_WAIT_S)

    @staticmethod
    def chunk(req: Request) -> SeqChunk:
        """`req`'s part of the next batch; an engine whose model needs more than the tokens
        (the replay engine: the request's own state) overrides it."""
        if not req.output:
            return SeqChunk(req.prompt[req.kv_len:], req.kv_len, req.pages)
        return SeqChunk([req.output[-1]], req.kv_len, req.pages)

    def _admit(self, req: Request) -> bool:
        """`plugin.admit`, timed into `admission_us` unless it only marks a request whose L3
        prefetch is under way as wanted (no cache work: not an admission attempt)."""
        if self.plugin.fetching(req):
            return self.plugin.admit(req)
        start = time.perf_counter()
        admitted = self.plugin.admit(req)
        self.admission_us.append((time.perf_counter() - start) * 1e6)
        return admitted

    def _layer_ready(self, admitted: list[Request]):
        """The forward pass's per-layer hook. Each layer gives the event loop's other tasks (the
        plugin's storage work) a turn, as awaiting a device would; newly admitted requests that
        reuse cached KV then wait for the layer to be on the device (loads), and the witness
        sees their cached pages before the layer reads them."""
        reused = [r for r in admitted if r.cached]

        async def ready(layer: int) -> None:
            await anyio.lowlevel.checkpoint()
            if reused:
                await self.plugin.layer_ready(reused, layer)
            for req in reused:
                self.witness.before_read(req, layer, self.pool.tensor[layer], self.plugin.kv_origin(req))
        return ready
