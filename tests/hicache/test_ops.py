"""The ledger offers and retires in FIFO order; copies complete per layer; eviction respects locks."""
import asyncio

import pytest
import torch

from hicache_async.clock import OpClock
from hicache_async.config import CacheConfig
from hicache_async.errors import PoolExhausted, SyncTimeout
from hicache_async.events import HostEvent, first_completion
from hicache_async.hicache.cache import TieredCache
from hicache_async.hicache.ledger import Ledger, StepMessage
from hicache_async.hicache.op_tracing import OpTracer
from hicache_async.hicache.ops import CacheOp
from hicache_async.kinds import TransferKind
from hicache_async.pools import DevicePool, HostPool, PageAllocator
from hicache_async.topology import RankCoords
from hicache_async.transfer.copier import Copier
from tests.helpers.layouts import LAYOUT


def _op(event):
    return CacheOp(TransferKind.WRITE, None, [event], 1, 0)


def _ledger(clock=None) -> Ledger:
    return Ledger(OpTracer("t", RankCoords(), "rank-suffix"), clock, timeout_s=1.0)


async def test_only_the_leading_completed_run_is_offered_and_retired():
    ledger = _ledger()
    events = [HostEvent() for _ in range(4)]
    ops = [_op(e) for e in events]
    for op in ops:
        ledger.issue(op)
    events[1].set()
    events[3].set()
    never = lambda op: False   # noqa: E731
    assert (await ledger.offer(1, never, 0)).writes == 0     # op 0 is not done: nothing behind it
    events[0].set()
    assert (await ledger.offer(2, never, 0)).writes == 2
    assert (await ledger.retire(StepMessage(writes=2), 2))[TransferKind.WRITE] == ops[:2]
    assert (await ledger.offer(3, never, 0)).writes == 0
    events[2].set()
    assert (await ledger.retire(await ledger.offer(4, never, 0), 4))[TransferKind.WRITE] == ops[2:]
    with pytest.raises(AssertionError):
        await ledger.retire(StepMessage(writes=1), 5)


class _Modelled(OpClock):
    """Due by a model: every op is due at once, whatever its event says."""

    modelled = True

    def due(self, op) -> bool:
        return True


async def test_a_modelled_clock_offers_ops_by_the_model_and_awaits_their_bytes():
    ledger = _ledger(_Modelled())
    event = HostEvent()
    ledger.issue(_op(event))
    asyncio.get_running_loop().call_later(0.02, event.set)
    assert (await ledger.offer(1, lambda op: False, 0)).writes == 1   # due: awaited till it landed
    assert event.query()
    stuck = _ledger(_Modelled())
    stuck.issue(_op(HostEvent()))
    stuck.timeout_s = 0.05
    with pytest.raises(SyncTimeout, match="write op due at step 7"):
        await stuck.offer(7, lambda op: False, 0)


def _retire(cache: TieredCache, writes: int, loads: int = 0) -> list[CacheOp]:
    """What on_step does for the cache's own queues, once every rank agreed."""
    retired = asyncio.run(cache.ledger.retire(StepMessage(writes=writes, loads=loads), 1))
    cache.retired(retired[TransferKind.WRITE] + retired[TransferKind.LOAD])
    return retired[TransferKind.WRITE]


async def test_event_wait_times_out_with_the_operation_named():
    with pytest.raises(SyncTimeout, match="load of layer 2"):
        await HostEvent().wait(0.05, "load of layer 2")
    event = HostEvent()
    asyncio.get_running_loop().call_later(0.01, event.set)
    await event.wait(1.0, "x")
    assert event.query()


async def test_waits_that_time_out_leave_no_waiter_behind():
    """An idle loop waits on a long storage op's event many times; set() must not then wake
    every one of those abandoned waits."""
    slow, other = HostEvent(), HostEvent()
    for _ in range(20):
        await first_completion([slow, other], 0.001)
        with pytest.raises(SyncTimeout):
            await slow.wait(0.001, "backup")
    assert slow._waiters == [] and other._waiters == []


def test_copier_round_trips_pages_layer_by_layer():
    device, host = DevicePool(LAYOUT, 8), HostPool(LAYOUT, 8)
    device.tensor.copy_(torch.randn_like(device.tensor))
    copier = Copier(device, host)
    events = copier.write([5, 2], [0, 7])
    assert len(events) == LAYOUT.num_layers
    asyncio.run(events[-1].wait(5, "write"))
    assert torch.equal(host.tensor[0], device.tensor[:, 5]) and torch.equal(host.tensor[7], device.tensor[:, 2])
    events = copier.load([0, 7], [1, 3])
    asyncio.run(events[-1].wait(5, "load"))
    assert all(e.query() for e in events)
    assert torch.equal(device.tensor[:, 1], device.tensor[:, 5])
    assert torch.equal(device.tensor[:, 3], device.tensor[:, 2])
    copier.close()


def test_allocator_says_which_tier_ran_out():
    alloc = PageAllocator(3, "host")
    alloc.alloc(2)
    with pytest.raises(PoolExhausted, match="host pool exhausted: need 2 pages, 1 free of 3"):
        alloc.alloc(2)


def test_eviction_under_pressure_spares_locked_pages():
    cfg = CacheConfig(device_pages=6, host_pages=6, page_size=4, write_policy="write_through")
    cache = TieredCache(cfg, DevicePool(LAYOUT, 6), HostPool(LAYOUT, 6))
    tokens_a, tokens_b = list(range(8)), list(range(100, 108))
    pages_a, pages_b = cache.alloc_device(2), cache.alloc_device(2)
    cache.insert(tokens_a, pages_a, ["a0", "a1"])
    cache.insert(tokens_b, pages_b, ["b0", "b1"])
    locked = cache.match(tokens_a).last_node
    cache.tree.lock_device(locked)
    assert cache.alloc_device(4) is None          # b is still being written: nothing to evict yet
    due = _retire(cache, writes=2)                # awaits the copies: agreed done
    assert [op.kind for op in due] == ["write", "write"] and not cache.ledger.busy()
    got = cache.alloc_device(4)
    assert got is not None and sorted(got[:2]) == sorted(pages_b)
    assert cache.match(tokens_a).device_pages == pages_a     # locked: still on the device
    assert cache.match(tokens_b).host_tokens == 8            # evicted to the host, not lost
    cache.close()


def test_selective_write_on_match_never_evicts_the_host_hits_it_returns():
    cfg = CacheConfig(device_pages=4, host_pages=1, page_size=4, write_policy="write_through_selective")
    cache = TieredCache(cfg, DevicePool(LAYOUT, 4), HostPool(LAYOUT, 1))
    tokens = list(range(8))
    pages = cache.alloc_device(2)
    cache.insert(tokens[:4], pages[:1], ["h0"])          # node D: one hit so far
    lower = cache.tree.insert(tokens, pages, ["h0", "h1"]).new_nodes[0]   # node A below it
    assert cache.write(lower)                            # A gets the only host page
    _retire(cache, writes=1)
    cache.free_device(cache.tree.evict_device(lower))    # A is now host-only
    match = cache.match(tokens)                          # D is hit again: selective writes it
    assert match.host_nodes == [lower] and lower.id in cache.tree.nodes
    assert lower.host is not None
    cache.close()
