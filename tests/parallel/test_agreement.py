"""The per-step agreement: reaping sends, MIN semantics, storage fields, divergence.

The send-reaping class is tested alone with Works whose completion the test controls; the
agreement itself across real gloo processes.
"""
import pytest

from hicache_async.api import EngineContext
from hicache_async.errors import DivergenceError, UsageError
from hicache_async.hicache.ledger import PREFETCH_SLOTS, StepMessage
from hicache_async.hicache.plugin import HiCachePlugin
from hicache_async.layout import KVLayout
from hicache_async.parallel.agreement import NOT_READY
from hicache_async.parallel.pp_sync import REAP_AGE_STEPS, InFlightSends
from hicache_async.pools import DevicePool
from hicache_async.sim.ranks.launcher import launch
from hicache_async.topology import RankCoords
from tests.helpers.agreement_targets import offer

COORDS = RankCoords.of(0, 1, 2, 1)


class SendWork:
    """A send Work that reports completion when the test says so, as NCCL's do."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waits += 1
        return True


async def test_completed_sends_are_reaped_as_soon_as_they_report_it():
    sends, works = InFlightSends(True, COORDS, 5), [SendWork() for _ in range(4)]
    for step, work in enumerate(works):
        sends.add(work, None, step)
    works[1].done = works[3].done = True
    await sends.reap(4)
    assert (len(sends), sends.reaped) == (2, 2)
    assert [w.waits for w in works] == [0, 1, 0, 1]
    await sends.reap(REAP_AGE_STEPS - 1)         # the others are not done and not old: kept
    assert len(sends) == 2
    await sends.reap(REAP_AGE_STEPS)             # the oldest is due: waited for, with its peer
    assert (len(sends), sends.reaped) == (0, 4)
    assert [w.waits for w in works] == [1, 1, 1, 1]


@pytest.mark.parametrize("reports_completion", [True, False])
async def test_sends_that_never_report_done_are_waited_once_by_age(reports_completion):
    sends, works = InFlightSends(reports_completion, COORDS, 5), [SendWork() for _ in range(100)]
    most = 0
    for step, work in enumerate(works):
        await sends.reap(step)
        sends.add(work, None, step)
        most = max(most, len(sends))
        assert all(w.waits == 1 for w in works[:max(0, step + 1 - REAP_AGE_STEPS)]), step
    assert most == REAP_AGE_STEPS
    await sends.flush()
    assert (len(sends), sends.issued, sends.reaped) == (0, 100, 100)
    assert {w.waits for w in works} == {1}       # gloo: wait() exactly once per send


def test_gloo_sends_are_reaped_by_age_and_every_one_is_received():
    steps = 3000
    first, last = launch(tp=1, pp=2, cp=1, target="tests.helpers.agreement_targets:many_steps",
                         payload={"steps": steps}, timeout_s=30)
    assert first["reports_completion"] is False
    assert first["most_pending_sends"] <= REAP_AGE_STEPS
    assert first["before_close"]["reaped"] >= steps - REAP_AGE_STEPS    # reaped while running
    assert first["after_close"]["sent"] == first["after_close"]["reaped"] == steps
    assert first["pending_after_close"] == 0
    assert last["after_close"]["received"] == steps
    assert (last["after_close"]["sent"], first["after_close"]["received"]) == (0, 0)


@pytest.mark.parametrize("tp,pp,cp", [(2, 2, 1), (1, 2, 2)])
def test_every_rank_retires_stage_zero_min(tp, pp, cp):
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.agreement_targets:counts", payload={}, timeout_s=30)
    for step in range(50):
        low = min(offer(r, step) for r in range(tp * cp))      # stage 0 is ranks 0 .. tp*cp-1
        assert all(r["seen"][step] == [low, low + 1] for r in results), step


def test_pending_storage_ops_retire_the_world_min_so_no_stage_waits_on_its_own():
    results = launch(tp=2, pp=2, cp=1, target="tests.helpers.agreement_targets:backups", payload={}, timeout_s=30)
    for step in range(20):
        ranks = range(4) if step % 2 else range(2)           # pending: the world; idle: stage 0
        want = min(offer(r, step) for r in ranks)
        assert [r["seen"][step] for r in results] == [want] * 4, step
    assert [r["world_reductions"] for r in results] == [10] * 4   # none on the idle steps


def test_divergence_between_two_first_stage_ranks_names_both():
    with pytest.raises(DivergenceError, match=r"step 5: first-stage ranks disagree \(rank 0 0x6, rank 1 0x3ee\)"):
        launch(tp=2, pp=1, cp=1, target="tests.helpers.agreement_targets:diverge",
               payload={"steps": 20, "odd_rank": 1, "at": 5}, timeout_s=20)


def test_divergence_on_a_later_stage_names_it():
    with pytest.raises(DivergenceError, match=r"step 3: rank 1 \(tp0 pp1 cp0\)"):
        launch(tp=1, pp=2, cp=1, target="tests.helpers.agreement_targets:diverge",
               payload={"steps": 20, "odd_rank": 1, "at": 3}, timeout_s=20)


def test_a_multi_rank_engine_without_an_agreement_is_refused():
    """Local agreement on a rank of a larger world would let its tree drift from its peers'."""
    layout = KVLayout(num_layers=2, kv_heads=1, head_dim=4, page_size=4)
    coords = RankCoords(tp_rank=1, tp_size=2)
    with pytest.raises(UsageError, match=r"rank 1 \(tp1 pp0 cp0\): a world of 2 ranks needs a cross-rank"):
        HiCachePlugin().attach(EngineContext(layout, DevicePool(layout, 4), coords))


def _min(*msgs: StepMessage) -> StepMessage:
    """What a MIN all_reduce of the packed messages gives every rank."""
    return StepMessage.unpack([min(fields) for fields in zip(*(m.pack() for m in msgs))])


def test_a_step_message_survives_packing_and_reduces_field_by_field():
    mine = StepMessage(writes=3, loads=1, backups=2, prefetches=2, prefetch_pages=(5, 0), l3_kbps=900)
    assert StepMessage.unpack(mine.pack()) == mine
    theirs = StepMessage(writes=1, loads=4, backups=2, prefetches=3, prefetch_pages=(2, 6, 1))
    agreed = _min(mine, theirs)
    # Only the prefetches every rank can retire are agreed, each with the pages all fetched.
    assert (agreed.writes, agreed.loads, agreed.backups) == (1, 1, 2)
    assert (agreed.prefetches, agreed.prefetch_pages, agreed.l3_kbps) == (2, (2, 0), 900)


def test_the_world_fields_are_exactly_the_l3_counts_pages_quiet_sets_and_throughput():
    msg = StepMessage(writes=3, loads=2, backups=1, prefetches=1, prefetch_pages=(4,), quiet=(1,), l3_kbps=50)
    assert msg.pack()[StepMessage.L3] == [1, 1, 4, NOT_READY, NOT_READY, NOT_READY, 1, 0, 0, 0, 50]


def test_a_message_with_pages_for_a_different_number_of_prefetches_is_refused():
    with pytest.raises(ValueError, match="2 prefetches with pages"):
        StepMessage(prefetches=2, prefetch_pages=(1,))
    with pytest.raises(ValueError, match=f"at most {PREFETCH_SLOTS}"):
        StepMessage(prefetches=PREFETCH_SLOTS + 1, prefetch_pages=(0,) * (PREFETCH_SLOTS + 1))
