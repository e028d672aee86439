"""The Copier's device path (the pools' pages as a DMA plan, moved by StreamCopies: the code a
CUDA pool runs) over the simulated device: every layout and page pattern lands byte for byte
against page-by-page references, across registrations' ends too; a load's layer event passes
once that layer landed, before later layers; and each fault a driver can raise (a batch
refused, a load's later layer refused, an event that never passes) completes the op's events
with CopyFailed, without hanging, up to the ledger's retirement."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hicache_async import faults
from hicache_async.errors import CopyFailed
from hicache_async.hicache.ledger import Ledger, StepMessage
from hicache_async.hicache.op_tracing import OpTracer
from hicache_async.hicache.ops import CacheOp
from hicache_async.kinds import TransferKind
from hicache_async.layout import KVLayout
from hicache_async.pools import DevicePool, HostPool
from hicache_async.topology import RankCoords
from hicache_async.transfer.copier import Copier
from hicache_async.transfer.device import SourceOrder
from hicache_async.transfer.sim_device import SimDevice
from tests.helpers.page_patterns import LAYOUTS, PATTERNS, POOL_PAGES, assert_moves_exactly, assert_round_trip, simulated

BIG, ONE_LAYER = LAYOUTS["big"], LAYOUTS["one layer"]


def _copier(layout: KVLayout = BIG, chunk_bytes: int | None = None, **device) -> tuple[Copier, SimDevice]:
    host = HostPool(layout, POOL_PAGES, chunk_bytes=chunk_bytes)
    sim = simulated(host, **device)
    return Copier(DevicePool(layout, POOL_PAGES), host, dma=sim), sim


def _settled(*events) -> None:
    for event in events:
        asyncio.run(event.wait(10, "copy"))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_pages_land_exactly_in_both_directions(pattern, layout):
    assert_round_trip(layout, *pattern, device="cpu", on_simulated_device=True)


@pytest.mark.parametrize("pages_a_chunk", [1, 2])
def test_consecutive_pages_join_into_one_copy_cut_where_registrations_meet(pages_a_chunk):
    """The device refuses a copy spanning two registrations, as the driver does."""
    copier, _ = _copier(ONE_LAYER, chunk_bytes=pages_a_chunk * ONE_LAYER.page_bytes)
    try:
        assert_moves_exactly(copier, list(range(2, 13)), list(range(3, 14)))
    finally:
        copier.close()


def test_a_write_is_one_batch_and_a_load_lands_a_layer_at_a_time():
    copier, sim = _copier(max_delay_s=0.01)
    host, device = copier.host.tensor, copier.device.tensor
    host.normal_()
    _settled(*copier.write([1, 2], [3, 4]))
    gate, real = threading.Event(), sim.copy

    def gated(copy, stream, order) -> None:
        if len(sim.orders) == 2:        # layer 1's batch: its stream holds until the gate opens
            stream.queue(lambda: gate.wait(10))
        real(copy, stream, order)
    sim.copy = gated
    events = copier.load([9, 2, 4], [7, 1, 12])
    _settled(events[0])
    assert events[0].error is None and torch.equal(device[0, [7, 1, 12]], host[[9, 2, 4], 0])
    assert not any(event.query() for event in events[1:])
    gate.set()
    for layer, event in enumerate(events):
        _settled(event)
        assert event.error is None and torch.equal(device[layer, [7, 1, 12]], host[[9, 2, 4], layer])
    assert sim.orders == [SourceOrder.STREAM] + [SourceOrder.ANY] * BIG.num_layers
    copier.close()


def test_a_refused_write_fails_every_event_and_the_next_op_lands():
    copier, sim = _copier()
    sim.fail_batch()
    events = copier.write([1, 2, 3], [4, 5, 6])
    _settled(*events)
    assert all(isinstance(e.error, CopyFailed) and "refused at copy 0" in str(e.error) for e in events)
    assert_moves_exactly(copier, [1, 2, 3], [4, 5, 6])
    copier.close()


def test_a_load_refused_at_a_later_layer_fails_from_that_layer_on_and_the_next_op_lands():
    copier, sim = _copier()
    host, device = copier.host.tensor, copier.device.tensor
    host.normal_()
    sim.fail_batch(skip=1)                          # layer 0's batch is queued, layer 1's refused
    events = copier.load([2, 3], [5, 9])
    _settled(*events)
    assert events[0].error is None and torch.equal(device[0, [5, 9]], host[[2, 3], 0])
    assert all(isinstance(e.error, CopyFailed) and "refused at copy 0" in str(e.error) for e in events[1:])
    assert_moves_exactly(copier, [2, 3], [5, 9])
    copier.close()


@pytest.mark.parametrize("kind", ["write", "load"])
def test_an_event_that_never_passes_fails_every_event_of_its_op_after_the_bound(kind):
    copier, sim = _copier(max_delay_s=0.0, bound_s=0.2)
    sim.stall_event()
    events = copier.write([1, 2], [3, 4]) if kind == "write" else copier.load([3, 4], [1, 2])
    _settled(*events)
    assert all(isinstance(e.error, CopyFailed) and "did not pass within 0.2 s" in str(e.error) for e in events)
    copier.close()


def test_pages_outside_either_pool_fail_the_op_before_anything_is_issued():
    copier, sim = _copier()
    for events in (copier.write([0, 1], [POOL_PAGES - 1, POOL_PAGES]), copier.load([0, 1], [-1, 0])):
        assert all(e.query() and isinstance(e.error, CopyFailed) and "outside the pool" in str(e.error)
                   for e in events)
    assert sim.orders == []
    copier.close()


def test_the_injected_copy_error_fails_the_first_write_only(monkeypatch):
    monkeypatch.setenv(faults.ENV, "copy-error")
    copier, sim = _copier()
    events = copier.write([1, 2], [3, 4])
    assert all(isinstance(e.error, CopyFailed) and "injected fault" in str(e.error) for e in events)
    assert_moves_exactly(copier, [1, 2], [3, 4])
    copier.close()


async def test_a_failed_write_fails_its_op_at_retirement_naming_it():
    copier, sim = _copier()
    sim.fail_batch()
    events = copier.write([1], [2])
    ledger = Ledger(OpTracer("t", RankCoords(), "rank-suffix"), timeout_s=5.0)
    ledger.issue(CacheOp(TransferKind.WRITE, None, events, 1, BIG.page_bytes))
    await events[-1].wait(10, "write")
    message = await ledger.offer(1, lambda op: False, 0)
    assert message.writes == 1
    with pytest.raises(CopyFailed, match="write op of 1 pages failed: .*refused at copy 0"):
        await ledger.retire(StepMessage(writes=1), 1)
    copier.close()
