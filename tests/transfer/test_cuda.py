"""The CUDA path: copy streams, real torch.cuda.Events, pinned host memory. Skips without a GPU."""
import asyncio

import pytest
import torch

from hicache_async.events import CudaEvent
from hicache_async.pools import DevicePool, HostPool
from hicache_async.transfer.block_copies import BlockCopies
from hicache_async.transfer.copier import Copier
from tests.helpers.block_round_trips import BLOCKS, assert_round_trip, host_pool, movable_layouts
from tests.helpers.layouts import LAYOUT
from tests.helpers.page_patterns import LAYOUTS, PATTERNS
from tests.helpers.page_patterns import assert_round_trip as assert_pages_round_trip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_host_pool_is_pinned_and_copies_complete_on_cuda_events():
    device, host = DevicePool(LAYOUT, 16, device="cuda"), HostPool(LAYOUT, 16)
    assert host.tensor.is_pinned()
    device.tensor.normal_()
    copier = Copier(device, host)
    events = copier.write([3, 4, 9], [0, 1, 2])
    assert len(events) == LAYOUT.num_layers and all(isinstance(e, CudaEvent) for e in events)
    asyncio.run(events[-1].wait(10, "write"))
    for d, h in ((3, 0), (4, 1), (9, 2)):
        assert torch.equal(host.tensor[h], device.tensor[:, d].cpu())
    events = copier.load([0, 1, 2], [10, 11, 12])
    asyncio.run(events[-1].wait(10, "load"))
    assert torch.equal(device.tensor[:, 10:13], device.tensor[:, [3, 4, 9]])


def test_copy_stream_waits_for_compute_that_produced_the_kv():
    device, host = DevicePool(LAYOUT, 4, device="cuda"), HostPool(LAYOUT, 4)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):                      # queue slow work on the compute stream first
        a = a @ a / 64
    device.tensor[:, 0].fill_(7)           # the value the copy must see
    events = Copier(device, host).write([0], [0])
    asyncio.run(events[-1].wait(30, "write"))
    assert bool((host.tensor[0] == 7).all())


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_pages_land_exactly_in_both_directions_on_cuda(pattern, layout):
    """The kernels read and write the pinned host pool in place: every pattern, byte for byte."""
    assert_pages_round_trip(layout, *pattern, device="cuda")


def test_host_pool_is_pinned_at_exactly_its_size_and_unpinned_on_close():
    host = HostPool(LAYOUT, 3)
    assert host.tensor.is_pinned() and host.tensor.untyped_storage().nbytes() == 3 * LAYOUT.page_bytes
    host.close()
    host.close()        # once: the second does nothing
    assert not host.tensor.is_pinned()


@pytest.mark.parametrize("name", ["LBHNC-packed", "LHBNC-split", "BHLNC-packed", "BLNHC-mla", "BLHNC-packed-padded"])
@pytest.mark.parametrize("slots,blocks", [([9, 0, 4, 6], [11, 2, 8, 5]), ([3, 4, 5], [10, 1, 7]), ([7], [3])])
def test_blocks_round_trip_byte_for_byte_on_cuda(name, slots, blocks):
    """The kernels read and write the pinned host pool in place, the blocks strided in vLLM's orders."""
    case = movable_layouts()[name]
    assert_round_trip(case.raw.cuda(), case.layers, slots, blocks, targets=[(b + 1) % BLOCKS for b in blocks])


def test_a_save_returns_before_the_compute_stream_is_done_and_copies_what_it_wrote():
    case = movable_layouts()["LBHNC-packed"]
    kv = case.layers(case.raw.cuda())
    host = host_pool(kv, 4)
    copies = BlockCopies(kv, host)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(16):                     # slow work on the compute stream first
        a = a @ a / 64
    for t in kv:
        t[3].fill_(7)                       # the value the save must see
    done = copies.save([1], [3])
    assert not done.query()                 # returned with the compute stream still busy: no synchronize
    copies.load([1], [5])                   # queued behind the save, so it reads what the save writes
    copies.wait_layer(0)                    # the compute stream waits for layer 0's copy, the CPU does not
    assert torch.equal(kv[0][5], kv[0][3])
    asyncio.run(done.wait(30, "save"))
    assert bool((host.tensor[1] == 7).all())
