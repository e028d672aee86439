"""Rank targets for the agreement tests (run inside simulated ranks)."""
from hicache_async.agreement import DIGEST, LOAD, WRITE, pack
from hicache_async.pp_sync import PipelineAgreement


async def many_steps(ctx) -> dict:
    """Agree `steps` times with nothing pending; report the most sends ever in flight."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    most = 0
    for step in range(ctx.payload["steps"]):
        agreement.reap()
        await agreement.agree(pack((0, 0, 0, 0), [], 7), step)
        most = max(most, agreement.pending_sends)
    final = agreement.pending_sends
    agreement.close()
    return {"most_pending_sends": most, "final_pending_sends": final}


async def counts(ctx) -> dict:
    """Each rank offers a different ready count; every rank must retire stage 0's MIN."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    seen = []
    for step in range(50):
        mine = (ctx.coords.rank * 3 + step) % 5
        agreed = await agreement.agree(pack((mine, mine + 1, 0, 0), [], 1), step)
        seen.append([agreed[WRITE], agreed[LOAD]])
    agreement.close()
    return {"seen": seen}


async def diverge(ctx) -> dict:
    """Rank `odd_rank` makes a different decision at step `at`: someone must raise."""
    agreement = PipelineAgreement(ctx.coords, ctx.groups, ctx.timeout_s)
    digest = 0
    for step in range(ctx.payload["steps"]):
        digest += 1
        if ctx.coords.rank == ctx.payload["odd_rank"] and step == ctx.payload["at"]:
            digest += 1000
        agreed = await agreement.agree(pack((0, 0, 0, 0), [], digest), step)
        assert agreed[DIGEST] == digest
    agreement.close()
    return {}


def stage_zero_min(tp: int, cp: int, step: int) -> list[int]:
    """What `counts` must agree on: the MIN over stage 0's ranks."""
    low = min((r * 3 + step) % 5 for r in range(tp * cp))
    return [low, low + 1]

