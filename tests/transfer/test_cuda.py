"""The CUDA path of both copy users, BlockCopies and the core's Copier: copy streams, real
torch.cuda.Events, pinned host memory, DMA on the copy engines, all through the device seam's
CUDA side (`CudaDevice`; the same code runs over the simulated device in
test_sim_stream_copies.py and test_sim_copier.py). Skips without a GPU (scripts/gpu_check.sh
runs it on one)."""
import asyncio
import time

import pytest
import torch

from hicache_async.pools import DevicePool, HostPool
from hicache_async.transfer import stream_copies
from hicache_async.transfer.block_copies import BlockCopies
from hicache_async.transfer.copier import Copier, CopyFailed
from hicache_async.transfer.device import CudaDevice
from tests.helpers.block_round_trips import (BLOCKS, ORDERS, Blocks, assert_round_trip, bits, host_pool,
                                             movable_layouts)
from tests.helpers.layouts import LAYOUT
from tests.helpers.page_patterns import LAYOUTS, PATTERNS, POOL_PAGES, assert_moves_exactly
from tests.helpers.page_patterns import assert_round_trip as assert_pages_round_trip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (host slots, blocks): a save moves block b[i] to slot s[i], a load the reverse.
BLOCK_PATTERNS = {
    "one": ([7], [3]),
    "runs": ([2, 3, 4], [5, 6, 7]),
    "scattered": ([9, 0, 4, 6], [11, 2, 8, 5]),
    "every block": (list(range(BLOCKS)), list(range(BLOCKS))),
}


def test_the_copier_moves_pages_by_dma_from_a_pinned_host_pool_a_layer_at_a_time():
    device, host = DevicePool(LAYOUT, 16, device="cuda"), HostPool(LAYOUT, 16)
    assert host.tensor.is_pinned()
    device.tensor.normal_()
    copier = Copier(device, host)
    assert isinstance(copier._streams.device, CudaDevice)
    events = copier.write([3, 4, 9], [0, 1, 2])
    assert len(events) == LAYOUT.num_layers
    asyncio.run(events[-1].wait(10, "write"))
    for d, h in ((3, 0), (4, 1), (9, 2)):
        assert torch.equal(host.tensor[h], device.tensor[:, d].cpu())
    events = copier.load([0, 1, 2], [10, 11, 12])
    for layer, event in enumerate(events):      # each layer landed once its event passed
        asyncio.run(event.wait(10, "load"))
        assert event.error is None and torch.equal(device.tensor[layer, 10:13], device.tensor[layer, [3, 4, 9]])
    copier.close()


def test_the_copiers_write_waits_for_compute_that_produced_the_kv():
    device, host = DevicePool(LAYOUT, 4, device="cuda"), HostPool(LAYOUT, 4)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):                      # queue slow work on the compute stream first
        a = a @ a / 64
    device.tensor[:, 0].fill_(7)           # the value the copy must see
    copier = Copier(device, host)
    events = copier.write([0], [0])
    asyncio.run(events[-1].wait(30, "write"))
    assert bool((host.tensor[0] == 7).all())
    copier.close()


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_pages_land_exactly_in_both_directions_on_cuda(pattern, layout):
    """The Copier's DMA between the device pool and the pinned host pool: every pattern, byte for byte."""
    assert_pages_round_trip(layout, *pattern, device="cuda")


@pytest.mark.parametrize("pages_a_chunk", [1, 2])
def test_the_copiers_consecutive_pages_are_cut_where_registrations_meet(pages_a_chunk):
    """One layer: consecutive pages join into one DMA, which the driver refuses across two
    `cudaHostRegister` calls unless the plan cuts it."""
    layout = LAYOUTS["one layer"]
    host = HostPool(layout, POOL_PAGES, chunk_bytes=pages_a_chunk * layout.page_bytes)
    copier = Copier(DevicePool(layout, POOL_PAGES, device="cuda"), host)
    try:
        assert_moves_exactly(copier, list(range(2, 13)), list(range(3, 14)))
    finally:
        copier.close()
        host.close()


def test_host_pool_is_pinned_at_exactly_its_size_and_unpinned_on_close():
    host = HostPool(LAYOUT, 3)
    assert host.tensor.is_pinned() and host.tensor.untyped_storage().nbytes() == 3 * LAYOUT.page_bytes
    host.close()
    host.close()        # once: the second does nothing
    assert not host.tensor.is_pinned()


def test_a_pool_of_several_registrations_is_pinned_throughout_and_unpinned_on_close():
    host = HostPool(LAYOUT, 20, chunk_bytes=1)
    assert host.chunk_bytes == 4096 == 8 * LAYOUT.page_bytes     # the smallest: 8 pages, one memory page
    assert all(host.tensor[page].is_pinned() for page in range(20))     # registered as 8, 8 and 4 pages
    host.close()
    assert not any(host.tensor[page].is_pinned() for page in range(20))


@pytest.mark.parametrize("blocks", movable_layouts().values(), ids=movable_layouts().keys())
@pytest.mark.parametrize("slots,moved", BLOCK_PATTERNS.values(), ids=BLOCK_PATTERNS.keys())
def test_every_layout_round_trips_byte_for_byte_by_dma(blocks, slots, moved):
    """The copy engines write the pinned host pool and the blocks strided in vLLM's orders,
    as plain per-block copies would."""
    assert_round_trip(blocks.raw.cuda(), blocks.layers, slots, moved, targets=[(b + 1) % BLOCKS for b in moved[::-1]])


@pytest.mark.parametrize("blocks", movable_layouts().values(), ids=movable_layouts().keys())
def test_every_layout_round_trips_by_dma_across_a_registrations_end(blocks):
    """The smallest registrations the pool allows (16 pages of 768 bytes: whole memory pages),
    every block into consecutive slots across the end of the first."""
    slots = list(range(10, 10 + BLOCKS))
    assert_round_trip(blocks.raw.cuda(), blocks.layers, slots, list(range(BLOCKS)),
                      targets=list(range(BLOCKS - 1, -1, -1)), chunk_bytes=1)


@pytest.mark.parametrize("pages_a_chunk", [1, 2])
@pytest.mark.parametrize("name", ["BLHNC", "LBHNC", "LHBNC"])
def test_a_pool_of_registrations_of_a_page_or_two_round_trips_by_dma(name, pages_a_chunk):
    """Pages of 12 KiB (whole memory pages): where a page is one run (BLHNC) the plan joins
    consecutive pages and must cut them where registrations meet, or the driver refuses them."""
    blocks = Blocks(ORDERS[name], 2, 256)
    every = list(range(BLOCKS))
    assert_round_trip(blocks.raw.cuda(), blocks.layers, every, every, targets=every[::-1],
                      chunk_bytes=pages_a_chunk * blocks.host().layout.page_bytes)


def _one_by_one(kv, host) -> BlockCopies:
    copies = BlockCopies(kv, host)
    copies._streams.device.dma._batch = None    # as where the driver has no cuMemcpyBatchAsync
    return copies


@pytest.mark.parametrize("name", ["LBHNC-packed", "LHBNC-split", "BLHNC-packed-padded"])
def test_a_driver_without_batches_gets_a_copy_per_descriptor(name):
    case = movable_layouts()[name]
    assert_round_trip(case.raw.cuda(), case.layers, [9, 0, 4, 6], [11, 2, 8, 5], targets=[1, 3, 6, 4],
                      copies_of=_one_by_one)


def _copies(name: str = "LBHNC-packed", slots: int = 2 * BLOCKS) -> tuple[list[torch.Tensor], HostPool, BlockCopies]:
    case = movable_layouts()[name]
    kv = case.layers(case.raw.cuda())
    host = host_pool(kv, slots)
    return kv, host, BlockCopies(kv, host)


def _busy_compute() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(16):                     # slow work on the compute stream
        a = a @ a / 64


def _hold(copies: BlockCopies, kind: str, seconds: float) -> None:
    """Keeps the thread of `kind` busy, as a long batch would."""
    copies._streams._threads[kind].submit(time.sleep, seconds)


def _settled(event, timeout_s: float = 30) -> None:
    asyncio.run(event.wait(timeout_s, "copy"))


def test_a_save_returns_before_the_compute_stream_is_done_and_copies_what_it_wrote():
    kv, host, copies = _copies()
    assert isinstance(copies._streams.device, CudaDevice)
    _busy_compute()
    for t in kv:
        t[3].fill_(7)                       # the value the save must see
    done = copies.save([1], [3])
    assert not done.query()                 # returned with the compute stream still busy: no synchronize
    _settled(done)
    assert done.error is None and bool((host.tensor[1] == 7).all())
    copies.load([1], [5])                   # a landed slot may be loaded
    copies.wait_layer(0)                    # the compute stream waits for layer 0's copy, the CPU does not
    assert torch.equal(kv[0][5], kv[0][3])
    copies.close()


def test_a_load_does_not_wait_for_the_save_thread():
    kv, host, copies = _copies()
    expected = host.tensor[4].clone()
    _hold(copies, "save", 1.0)
    saved = copies.save([1], [3])
    start = time.perf_counter()
    loaded = copies.load([4], [6])
    assert time.perf_counter() - start < 0.5
    copies.wait_loads()
    torch.cuda.synchronize()
    assert not saved.query()                # the save is still held: the load went first
    assert loaded.query() and loaded.error is None
    assert all(torch.equal(bits(kv[layer][6].cpu()), bits(expected[layer])) for layer in range(len(kv)))
    copies.close()


def test_wait_layer_waits_on_the_cpu_until_its_event_is_recorded_and_bounds_the_wait(monkeypatch):
    kv, host, copies = _copies()
    _hold(copies, "load", 0.3)
    start = time.perf_counter()
    loaded = copies.load([4], [6])
    copies.wait_layer(0)
    assert time.perf_counter() - start >= 0.25      # its copies were not issued before the hold ended
    copies.wait_loads()
    torch.cuda.synchronize()
    assert loaded.query() and torch.equal(bits(kv[2][6].cpu()), bits(host.tensor[4, 2]))

    monkeypatch.setattr(stream_copies, "ISSUE_TIMEOUT_S", 0.1)
    _hold(copies, "load", 1.0)
    copies.load([5], [7])
    with pytest.raises(CopyFailed, match="layer 0's copies were not issued within 0.1 s"):
        copies.wait_layer(0)
    copies.close()


def test_fence_saves_puts_the_compute_stream_behind_saves_not_yet_issued():
    """A preempted request's block goes to another, which writes it at once: the save must
    still copy what the preempted request left there."""
    kv, host, copies = _copies()
    for t in kv:
        t[3].fill_(7)
    _hold(copies, "save", 0.3)              # the save's copies are issued 0.3 s from now
    saved = copies.save([1], [3])
    copies.fence_saves(10)
    for t in kv:
        t[3].fill_(9)                       # the next owner's KV, on the compute stream
    _settled(saved)
    torch.cuda.synchronize()
    assert saved.error is None and bool((host.tensor[1] == 7).all())
    copies.close()


def test_fence_saves_gives_up_after_its_timeout_naming_itself():
    _, _, copies = _copies()
    _hold(copies, "save", 1.0)
    copies.save([1], [3])
    with pytest.raises(CopyFailed, match="fence_saves"):
        copies.fence_saves(0.1)
    copies.close()


def test_close_finishes_what_was_handed_over_and_refuses_later_copies():
    kv, host, copies = _copies()
    for t in kv:
        t[3].fill_(5)
    _hold(copies, "save", 0.2)
    copies.save([1], [3])
    copies.close()                          # no wait of ours: close issues the save and syncs its stream
    assert bool((host.tensor[1] == 5).all())
    copies.close()                          # once
    for late in (copies.save([2], [4]), copies.load([1], [6])):
        assert late.query() and isinstance(late.error, CopyFailed)
    copies.wait_layer(0)                    # a refused load leaves nothing to wait for
    copies.wait_loads()


def test_no_copy_is_issued_while_a_cuda_graph_is_captured():
    kv, host, copies = _copies()
    before_host, before_kv = host.tensor.clone(), [t.clone() for t in kv]
    static = torch.ones(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.mul_(2)
        events = [copies.load([1], [5]), copies.save([2], [3])]
    graph.replay()
    torch.cuda.synchronize()
    for event in events:
        assert event.query() and isinstance(event.error, CopyFailed) and "captured" in str(event.error)
    assert torch.equal(bits(host.tensor), bits(before_host))
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip(kv, before_kv))
    saved = copies.save([2], [3])           # outside the capture, copies run again
    _settled(saved)
    assert saved.error is None
    copies.close()


def test_a_failed_copy_completes_its_event_with_the_error_and_the_threads_go_on():
    kv, host, copies = _copies()
    real = copies._streams.device.copy

    def refused(copy, stream, order):
        raise RuntimeError("injected DMA failure")
    copies._streams.device.copy = refused
    saved, loaded = copies.save([1], [3]), copies.load([4], [6])
    copies.wait_layer(0)                    # the load failed: nothing to wait for, and no raise into the caller
    copies.wait_loads()
    for event in (saved, loaded):
        _settled(event)
        assert isinstance(event.error, CopyFailed) and "injected DMA failure" in str(event.error)
    copies._streams.device.copy = real
    saved = copies.save([1], [3])
    _settled(saved)
    assert saved.error is None and torch.equal(bits(host.tensor[1, 0]), bits(kv[0][3].cpu()))
    copies.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_copy_threads_run_on_the_kvs_device():
    case = movable_layouts()["LBHNC-packed"]
    kv = case.layers(case.raw.to("cuda:1"))
    with torch.cuda.device(1):
        host = host_pool(kv, 2 * BLOCKS)
    copies = BlockCopies(kv, host)
    _settled(copies.save([1], [3]))
    for kind in ("load", "save"):
        assert copies._streams._threads[kind].submit(torch.cuda.current_device).result() == 1
    copies.close()
