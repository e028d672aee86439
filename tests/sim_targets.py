"""Rank targets that run several small cached workloads in one launch (process start is costly)."""
import dataclasses

from hicache_async.cache import TieredCache
from hicache_async.rank_main import run_rank


async def matrix(ctx) -> dict:
    return {name: await run_rank(dataclasses.replace(ctx, payload=payload))
            for name, payload in ctx.payload["runs"].items()}


async def skip_one_insert(ctx) -> dict:
    """Rank `odd_rank` silently skips caching its third finished request: a divergent decision."""
    if ctx.coords.rank == ctx.payload["odd_rank"]:
        original, calls = TieredCache.insert, [0]

        def insert(self, tokens, pages, hashes):
            calls[0] += 1
            return list(pages) if calls[0] == 3 else original(self, tokens, pages, hashes)
        TieredCache.insert = insert
    return await run_rank(ctx)
