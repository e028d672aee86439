"""Rank targets for the agreement tests (run inside simulated ranks)."""
from hicache_async.parallel.pp_sync import PipelineAgreement


async def many_steps(ctx) -> dict:
    """Reap and agree `steps` times with nothing pending, as on_step does; then close."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    most = 0
    for step in range(ctx.payload["steps"]):
        await agreement.reap()
        await agreement.agree([0, 0], 7, step)
        most = max(most, agreement.pending_sends)
    before_close = agreement.counts()
    await agreement.close()
    return {"most_pending_sends": most, "before_close": before_close, "after_close": agreement.counts(),
            "pending_after_close": agreement.pending_sends,
            "reports_completion": agreement.sends.reports_completion}


def offer(rank: int, step: int) -> int:
    """What each rank offers for a count at a step: differs between ranks and steps."""
    return (rank * 3 + step) % 5


async def counts(ctx) -> dict:
    """Each rank offers a different ready count; every rank must retire stage 0's MIN."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    seen = []
    for step in range(50):
        mine = offer(ctx.coords.rank, step)
        seen.append(await agreement.agree([mine, mine + 1], 1, step))
    await agreement.close()
    return {"seen": seen}


async def backups(ctx) -> dict:
    """Each rank offers its own ready backups; the field is agreed world-wide on odd steps only."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    seen = []
    for step in range(20):
        agreed = await agreement.agree([7, offer(ctx.coords.rank, step)], 1, step,
                                       world=slice(1, 2) if step % 2 == 1 else None)
        seen.append(agreed[1])
    await agreement.close()
    return {"seen": seen, "world_reductions": agreement.world_reductions}


async def diverge(ctx) -> dict:
    """Rank `odd_rank` makes a different decision at step `at`: someone must raise."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    digest = 0
    for step in range(ctx.payload["steps"]):
        digest += 1
        if ctx.coords.rank == ctx.payload["odd_rank"] and step == ctx.payload["at"]:
            digest += 1000
        assert await agreement.agree([step], digest, step) == [step]
    await agreement.close()
    return {}
