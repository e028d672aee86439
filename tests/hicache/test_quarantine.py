"""The ledger's quarantine: host pages that a storage call given up on may still write into go
back to the pool only once every rank agrees none can, and at the same step on every rank.

Two ledgers stand for two ranks here; their offers are combined as the agreement combines them
(MIN per field), so what is tested is the ledger's side of the protocol. Real ranks run it in
`tests/storage/test_late_writes.py` (an installed backend under `simulate --tp 2`)."""
from concurrent.futures import Future

import pytest

from hicache_async.hicache.ledger import Ledger, StepMessage
from hicache_async.hicache.op_tracing import OpTracer
from hicache_async.hicache.quarantine import HELD_SLOTS
from hicache_async.storage.base import AbandonedCall
from hicache_async.topology import RankCoords

NEVER = lambda op: False   # noqa: E731 - no prefetch for a policy to give up on


class Rank:
    """A ledger and the pages its pool got back."""

    def __init__(self, name: str) -> None:
        self.ledger = Ledger(OpTracer(name, RankCoords(), "rank-suffix"), timeout_s=1.0)
        self.freed: list[int] = []

    def hold(self, pages: list[int], *late: Future) -> None:
        self.ledger.hold(pages, [AbandonedCall("given up on", call) for call in late], self.freed.extend)


async def _step(ranks: list[Rank], step: int) -> StepMessage:
    offers = [(await rank.ledger.offer(step, NEVER, 0)).pack() for rank in ranks]
    agreed = StepMessage.unpack([min(values) for values in zip(*offers)])
    for rank in ranks:
        await rank.ledger.retire(agreed, step)
    return agreed


async def test_held_pages_go_back_only_once_every_ranks_calls_into_them_returned():
    a, b = Rank("a"), Rank("b")
    on_a, on_b = Future(), Future()        # a call given up on, on one rank each
    for rank in (a, b):
        rank.hold([0, 1], *([on_a] if rank is a else []))
        rank.hold([2], *([on_b] if rank is b else []))
        rank.hold([3, 4])
        assert rank.ledger.l3_active()     # held pages keep the world-wide agreement on
    assert (await _step([a, b], 1)).quiet == (0, 0, 1, 0)
    assert a.freed == b.freed == [3, 4]    # only the set no rank's call can still write into
    on_b.set_result(None)
    await _step([a, b], 2)
    assert a.freed == b.freed == [3, 4, 2]
    await _step([a, b], 3)
    assert a.freed == b.freed == [3, 4, 2]  # a's call still runs: its set stays out, on both ranks
    assert (a.ledger.quarantine.late_pages(), b.ledger.quarantine.late_pages()) == (2, 0)
    on_a.set_result(None)
    await _step([a, b], 4)
    assert a.freed == b.freed == [3, 4, 2, 0, 1]
    assert not a.ledger.quarantine and not a.ledger.l3_active()
    assert a.ledger.digest == b.ledger.digest


async def test_a_call_that_never_returns_holds_its_own_pages_not_the_sets_behind_it():
    rank, hung = Rank("a"), Future()
    rank.hold([0], hung)
    sets = [[p] for p in range(1, HELD_SLOTS + 3)]
    for pages in sets:
        rank.hold(pages)
    for step in range(1, 4):
        await _step([rank], step)
    assert sorted(rank.freed) == [p for pages in sets for p in pages]
    assert len(rank.ledger.quarantine) == 1 and rank.ledger.quarantine.late_pages() == 1
    assert rank.ledger.quarantine.close() == 1 and 0 not in rank.freed   # kept from the pool for good


def test_the_step_message_carries_a_quiet_slot_per_held_set_in_the_l3_fields():
    message = StepMessage(writes=1, prefetches=1, prefetch_pages=(3,), quiet=(1, 0), l3_kbps=9)
    packed = message.pack()
    assert packed[StepMessage.L3][-1 - HELD_SLOTS:-1] == [1, 0] + [0] * (HELD_SLOTS - 2)
    assert StepMessage.unpack(packed) == message
    with pytest.raises(ValueError, match="held sets"):
        StepMessage(quiet=(1,) * (HELD_SLOTS + 1))
