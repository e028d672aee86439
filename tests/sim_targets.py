"""Rank targets that run several small cached workloads in one launch (process start is costly)."""
import dataclasses

from hicache_async.rank_main import run_rank


async def matrix(ctx) -> dict:
    return {name: await run_rank(dataclasses.replace(ctx, payload=payload))
            for name, payload in ctx.payload["runs"].items()}
