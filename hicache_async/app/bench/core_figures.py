"""Single-process figures: the idle cost of `on_step`, L1<->L2 copy bandwidth, tracing overhead."""
from __future__ import annotations

import asyncio
import random
import statistics
import time

import torch

from ...api import EngineContext
from ...config import CacheConfig
from ...hicache.plugin import HiCachePlugin
from ...layout import KVLayout
from ...parallel.topology import RankCoords
from ...telemetry import spans
from ...transfer.copier import Copier
from ...transfer.pool import DevicePool, HostPool
from .figure import figure

# A realistic page: 32 layers x 8 kv heads x 128 dims x 16 tokens, K and V, fp16 = 2 MiB.
BIG = KVLayout(num_layers=32, kv_heads=8, head_dim=128, page_size=16, dtype=torch.float16)


async def _noop() -> None:
    pass


def on_step_idle(steps: int) -> dict:
    """A one-rank `on_step` with nothing pending, beside an `await` of a no-op coroutine.

    Neither suspends (one rank has no one to agree with), so the difference is exactly what
    the hook itself does: the busy check and the step bookkeeping."""
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=16)
    plugin = HiCachePlugin(CacheConfig(device_pages=8, host_pages=8))
    plugin.attach(EngineContext(layout, DevicePool(layout, 8), RankCoords()))

    async def run(step) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            await step()
        return (time.perf_counter() - start) / steps * 1e6

    async def both() -> tuple[float, float]:
        async with plugin:
            pairs = [(await run(plugin.on_step), await run(_noop)) for _ in range(5)]   # interleaved
        return min(a for a, _ in pairs), min(b for _, b in pairs)

    idle, baseline = asyncio.run(both())
    return figure("on_step_idle_us", idle, "us", "await_noop_coroutine_us", baseline)


class _Transfers:
    """Write then load `pages` pages per op through the Copier, like the cache does.

    The op's pages on both sides are `contiguous`; `permuted` (a random permutation of the
    pools' pages, so every page moves alone yet the destinations form a run); or
    `scattered` (random pages of pools twice the op's size, in random order, so neither
    side is a run: each layer is a gather and a scatter)."""

    def __init__(self, pages: int, pattern: str = "contiguous") -> None:
        pool = 2 * pages if pattern == "scattered" else pages
        self.device, self.host = DevicePool(BIG, pool), HostPool(BIG, pool)
        self.device.tensor.normal_()
        self.copier = Copier(self.device, self.host)
        rng = random.Random(0)
        self.device_pages, self.host_pages = ((list(range(pages)), list(range(pages))) if pattern == "contiguous"
                                              else (rng.sample(range(pool), pages), rng.sample(range(pool), pages)))
        self.nbytes = pages * BIG.page_bytes

    async def round_trip(self, traced: bool) -> None:
        for kind in ("write", "load"):
            events = (self.copier.write(self.device_pages, self.host_pages) if kind == "write"
                      else self.copier.load(self.host_pages, self.device_pages))
            span = (spans.start_transfer(kind, pages=len(self.host_pages),
                                             nbytes=self.nbytes, coords=RankCoords()) if traced else None)
            await events[-1].wait(60, f"bench {kind}")
            if span is not None:
                spans.finish_transfer(span)

    def gbps(self, traced: bool, reps: int) -> float:
        async def run() -> float:
            start = time.perf_counter()
            for _ in range(reps):
                await self.round_trip(traced)
            return time.perf_counter() - start
        return 2 * reps * self.nbytes / asyncio.run(run()) / 1e9


def l1_l2_copy(pages: int, reps: int, rounds: int) -> list[dict]:
    """Each page pattern beside `tensor.copy_` of the same bytes."""
    return [_copy_figure(pages, reps, rounds, pattern) for pattern in ("contiguous", "permuted", "scattered")]


def _copy_figure(pages: int, reps: int, rounds: int, pattern: str) -> dict:
    """Medians of interleaved rounds: on a shared machine the best of each can come from
    different moments, while each round's pair shares its moment's load."""
    t = _Transfers(pages, pattern)
    src = torch.randn(t.nbytes // 2, dtype=torch.float16)
    dst = torch.empty_like(src)

    def plain() -> float:
        start = time.perf_counter()
        for _ in range(2 * reps):
            dst.copy_(src)
        return 2 * reps * t.nbytes / (time.perf_counter() - start) / 1e9

    pairs = [(t.gbps(False, reps), plain()) for _ in range(rounds)]   # interleaved: shared noise
    value, baseline = statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)
    t.copier.close()
    return figure(f"l1_l2_copy_{pattern}_gbps", value, "GB/s", "tensor_copy_gbps", baseline)


def _pair(t: _Transfers, reps: int, on_first: bool) -> tuple[float, float]:
    """(off, on) throughput, measured in the given order."""
    if on_first:
        on = t.gbps(True, reps)
        return t.gbps(False, reps), on
    return t.gbps(False, reps), t.gbps(True, reps)


def tracing_overhead(pages: int, reps: int, rounds: int) -> dict:
    """Throughput with spans exported through a BatchSpanProcessor vs tracing off, same run.

    Rounds interleave off and on, swapping which goes first (the second run of a pair is
    systematically faster here), so drift and order hit both alike; medians are compared."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class EncodingExporter(SpanExporter):
        """Encodes every batch to OTLP protobuf, as the HTTP exporter does, then drops it."""

        def export(self, spans):
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    t = _Transfers(pages)
    t.gbps(False, reps)                 # warm up before anything is compared
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(EncodingExporter()))
    trace.set_tracer_provider(provider)
    pairs = [_pair(t, reps, on_first=bool(i % 2)) for i in range(rounds)]
    provider.shutdown()
    t.copier.close()
    off = statistics.median(a for a, _ in pairs)
    on = statistics.median(b for _, b in pairs)
    result = figure("tracing_overhead_pct", (off - on) / off * 100, "%", "tracing_off_gbps", off)
    result["ratio"] = round(on / off, 3)
    return result
