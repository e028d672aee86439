"""BlockCopies' device branch (StreamCopies, the code CUDA runs) over the simulated device: copies
land later than issued, bytes checked against plain per-block copies; each fault a driver can
raise (a batch refused, one failing part-way, a later batch of a load refused, an event that
never passes) fails its op without hanging, and never before the copies it queued have passed;
a graph under capture is refused; each direction declares its source order."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import wait

import pytest
import torch

from hicache_async.errors import UsageError
from hicache_async.transfer.block_copies import BlockCopies
from hicache_async.transfer.copier import CopyFailed
from hicache_async.transfer.device import SourceOrder
from hicache_async.transfer.sim_device import SimDevice
from tests.helpers.block_round_trips import BLOCKS, LAYERS, bits, host_pool, movable_layouts


def _copies(delay_s: float = 0.02, bound_s: float = 5.0, seed: int = 1):
    case = movable_layouts()["LBHNC-packed"]
    kv = case.layers(case.raw.clone())
    host = host_pool(kv, 2 * BLOCKS)
    device = SimDevice(seed=seed, max_delay_s=delay_s, bound_s=bound_s)
    device.register(host)
    return kv, host, device, BlockCopies(kv, host, device=device)


def _settled(event, timeout_s: float = 10) -> None:
    asyncio.run(event.wait(timeout_s, "copy"))


def _hold(copies: BlockCopies, kind: str) -> threading.Event:
    """Holds the stream of `kind` where it is, as a long copy ahead would, until the gate is set."""
    gate = threading.Event()
    copies._streams._streams[kind].queue(lambda: gate.wait(10))
    return gate


def _issued(copies: BlockCopies, kind: str) -> None:
    """Returns once the thread of `kind` has issued (or given up on) what it was handed."""
    assert wait([copies._streams._threads[kind].submit(lambda: None)], timeout=10).done


def _blocks(kv, block: int) -> list[torch.Tensor]:
    return [bits(t[block]).clone() for t in kv]


def test_an_unregistered_host_pool_is_refused_in_one_line():
    case = movable_layouts()["LBHNC-packed"]
    kv = case.layers()
    with pytest.raises(UsageError, match="^the host pool must be pinned for device copies") as refused:
        BlockCopies(kv, host_pool(kv, 4), device=SimDevice())
    assert "\n" not in str(refused.value)


def test_a_save_returns_before_its_copies_land_and_a_load_lands_a_layer_at_a_time():
    kv, host, device, copies = _copies(delay_s=0.05)
    expected = [bits(t[3]).clone() for t in kv]
    saved = copies.save([1], [3])
    assert not saved.query()                        # handed over, not yet copied
    _settled(saved)
    assert saved.error is None and all(torch.equal(bits(host.tensor[1, layer]), expected[layer])
                                       for layer in range(LAYERS))
    loaded = copies.load([1, 4], [5, 6])
    copies.wait_layer(0)                            # the caller (compute stream) waits for layer 0 only
    assert torch.equal(bits(kv[0][5]), expected[0]) and torch.equal(bits(kv[0][6]), bits(host.tensor[4, 0]))
    copies.wait_loads()
    _settled(loaded)
    assert loaded.error is None and torch.equal(bits(kv[LAYERS - 1][5]), expected[LAYERS - 1])
    assert device.orders == [SourceOrder.STREAM] + [SourceOrder.ANY] * LAYERS   # B3: loads ANY, saves STREAM
    copies.close()


def test_fence_saves_holds_the_compute_stream_until_the_saves_copied_what_the_block_held():
    kv, host, _, copies = _copies(delay_s=0.05)
    for t in kv:
        t[3].fill_(7)
    saved = copies.save([1], [3])
    copies.fence_saves(10)
    for t in kv:
        t[3].fill_(9)                               # the next owner's KV, written after the fence
    _settled(saved)
    assert saved.error is None and bool((host.tensor[1] == 7).all())
    copies.close()


def test_a_save_failing_part_way_is_reported_only_once_its_queued_copies_landed():
    kv, host, device, copies = _copies(delay_s=0.01)
    before = host.tensor.clone()
    gate = _hold(copies, "save")
    device.fail_batch(after=2)                      # LBHNC: a descriptor a head, layer and block
    saved = copies.save([1, 2], [3, 4])
    _issued(copies, "save")
    assert not saved.query()                        # the thread gave up; its first copies are still queued
    gate.set()
    _settled(saved)
    assert isinstance(saved.error, CopyFailed) and "refused at copy 2" in str(saved.error)
    landed = host.tensor.clone()
    copies.close()                                  # nothing still writes once the failure was reported
    assert torch.equal(bits(host.tensor), bits(landed)) and not torch.equal(bits(landed), bits(before))


def test_a_load_whose_later_batch_is_refused_holds_the_compute_stream_until_its_earlier_layers_landed():
    kv, host, device, copies = _copies(delay_s=0.01)
    gate = _hold(copies, "load")
    device.fail_batch(skip=1)                       # layer 0's batch is queued, layer 1's refused
    loaded = copies.load([4], [6])
    _issued(copies, "load")
    assert not loaded.query()
    threading.Timer(0.1, gate.set).start()
    copies.wait_layer(1)                            # waits on the event after what was queued
    assert torch.equal(bits(kv[0][6]), bits(host.tensor[4, 0]))
    copies.wait_loads()
    _settled(loaded)
    assert isinstance(loaded.error, CopyFailed) and "refused at copy 0" in str(loaded.error)
    after = _blocks(kv, 6)
    copies.close()
    assert all(torch.equal(a, b) for a, b in zip(after, _blocks(kv, 6)))


def test_a_batch_refused_whole_fails_its_op_and_the_threads_go_on():
    kv, host, device, copies = _copies(delay_s=0.01)
    device.fail_batch()
    device.fail_batch(skip=1)
    saved = copies.save([1], [3])
    _settled(saved)
    loaded = copies.load([4], [6])
    copies.wait_loads()                             # nothing queued for layer 0: nothing to wait for
    _settled(loaded)
    for event in (saved, loaded):
        assert isinstance(event.error, CopyFailed) and "refused at copy 0" in str(event.error)
    saved = copies.save([1], [3])
    _settled(saved)
    assert saved.error is None and torch.equal(bits(host.tensor[1, 0]), bits(kv[0][3]))
    copies.close()


def test_an_event_that_never_passes_fails_its_op_after_the_bound_and_the_fence_raises():
    _, _, device, copies = _copies(delay_s=0.0, bound_s=0.2)
    device.stall_event()
    saved = copies.save([1], [3])
    _settled(saved)
    assert isinstance(saved.error, CopyFailed) and "did not pass within 0.2 s" in str(saved.error)
    assert "\n" not in str(saved.error)
    with pytest.raises(RuntimeError, match="did not pass within 0.2 s"):
        copies.fence_saves(5)
    copies.close()


def test_no_copy_is_issued_while_a_graph_is_captured():
    kv, host, device, copies = _copies()
    before_host, before_kv = host.tensor.clone(), [t.clone() for t in kv]
    device.capturing_graph = True
    events = [copies.load([1], [5]), copies.save([2], [3])]
    copies.wait_layer(0)
    copies.fence_saves(1)
    for event in events:
        assert event.query() and isinstance(event.error, CopyFailed) and "captured" in str(event.error)
    device.capturing_graph = False
    saved = copies.save([2], [3])                   # outside the capture, copies run again
    _settled(saved)
    assert saved.error is None and device.orders == [SourceOrder.STREAM]
    host.tensor[2] = before_host[2]
    copies.close()
    assert torch.equal(bits(host.tensor), bits(before_host))
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip(kv, before_kv))


def test_close_finishes_what_was_handed_over_and_refuses_later_copies():
    kv, host, _, copies = _copies(delay_s=0.05)
    for t in kv:
        t[3].fill_(5)
    copies.save([1], [3])
    copies.close()
    assert bool((host.tensor[1] == 5).all())
    copies.close()                                  # once
    for late in (copies.save([2], [4]), copies.load([1], [6])):
        assert late.query() and isinstance(late.error, CopyFailed)
    copies.wait_layer(0)
    copies.wait_loads()
