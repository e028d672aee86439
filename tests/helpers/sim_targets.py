"""Rank targets that run several small cached workloads in one launch (process start is costly)."""
import dataclasses
import time

from hicache_async.hicache.cache import TieredCache
from hicache_async.hicache.prefetch_cost import PrefetchCost
from hicache_async.sim.jobs.simulate_rank import run_rank
from hicache_async.transfer.page_store import PageStore


async def matrix(ctx) -> dict:
    return {name: await run_rank(dataclasses.replace(ctx, payload=payload))
            for name, payload in ctx.payload["runs"].items()}


async def skip_one_insert(ctx) -> dict:
    """Rank `odd_rank` silently skips caching its third finished request: a divergent decision."""
    if ctx.coords.rank == ctx.payload["odd_rank"]:
        original, calls = TieredCache.insert, [0]

        def insert(self, tokens, pages, hashes, salt=None):
            calls[0] += 1
            return list(pages) if calls[0] == 3 else original(self, tokens, pages, hashes, salt)
        TieredCache.insert = insert
    return await run_rank(ctx)


async def odd_rank_fetches_less(ctx) -> dict:
    """Rank `odd_rank` reports one page fewer from every prefetch that fetched any: ranks
    disagree on prefetched pages, and only what every rank has may be committed."""
    if ctx.coords.rank == ctx.payload["odd_rank"]:
        original = PageStore.prefetch

        def prefetch(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            result.pages = max(0, result.pages - 1)
            return result
        PageStore.prefetch = prefetch
    return await run_rank(ctx)


async def slow_prefetch(ctx) -> dict:
    """Every prefetch takes `delay_s` before it starts reading: the timeout policy must end it."""
    original = PageStore.prefetch

    def prefetch(self, *args, **kwargs):
        time.sleep(ctx.payload["delay_s"])
        return original(self, *args, **kwargs)
    PageStore.prefetch = prefetch
    return await run_rank(ctx)


async def slow_stage_records_throughput(ctx) -> dict:
    """Pipeline stage 1 reads L3 `slowdown` times slower than stage 0; every rank records the
    L3 throughput it offers at each agreement and the figure agreed."""
    if ctx.coords.pp_rank == 1:
        original = PageStore.prefetch

        def prefetch(self, hashes, *args, **kwargs):
            time.sleep(ctx.payload["delay_s_per_page"] * len(hashes))
            return original(self, hashes, *args, **kwargs)
        PageStore.prefetch = prefetch
    offered, agreed = [], []
    offer, agree = PrefetchCost.offer, PrefetchCost.agreed

    def recording_offer(self):
        offered.append(offer(self))
        return offered[-1]

    def recording_agreed(self, kbps):
        agreed.append(kbps)
        agree(self, kbps)
    PrefetchCost.offer, PrefetchCost.agreed = recording_offer, recording_agreed
    report = await run_rank(ctx)
    return {**report, "offered": offered, "agreed": agreed}
