"""BlockCopies on CPU: byte-exact round trips between strided per-layer block tensors and host
pages in every physical order vLLM 0.32 lays a layer out in, by the CPU kernels and by the
device branch over the simulated device (DMA descriptors landing later than issued), the
refusal of token-major blocks, and a step's copy calls not growing with its block count."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hicache_async.errors import UsageError
from hicache_async.pools import HostPool
from hicache_async.transfer.block_copies import BlockCopies
from hicache_async.transfer.sim_device import SimDevice
from tests.helpers.block_round_trips import (BLOCKS, CONTENTS, LAYERS, ORDERS, TOKEN_MAJOR, Blocks,
                                             assert_round_trip, bits, movable_layouts)

# (host slots, blocks): a save moves block b[i] to slot s[i], a load the reverse.
PATTERNS = {
    "empty": ([], []),
    "one": ([7], [3]),
    "runs": ([2, 3, 4], [5, 6, 7]),
    "scattered": ([9, 0, 4, 6], [11, 2, 8, 5]),
    "scattered to a run": ([9, 0, 4, 6], [4, 5, 6, 7]),
    "a run to scattered": ([3, 4, 5, 6], [10, 1, 7, 0]),
}


@pytest.mark.parametrize("blocks", movable_layouts().values(), ids=movable_layouts().keys())
@pytest.mark.parametrize("slots,moved", PATTERNS.values(), ids=PATTERNS.keys())
def test_blocks_round_trip_byte_for_byte(blocks, slots, moved):
    assert_round_trip(blocks.raw, blocks.layers, slots, moved, targets=[(b + 1) % BLOCKS for b in moved[::-1]])


def _simulated(kv: list[torch.Tensor], host: HostPool) -> BlockCopies:
    device = SimDevice(seed=1, max_delay_s=2e-4)
    device.register(host)
    return BlockCopies(kv, host, device=device)


@pytest.mark.parametrize("blocks", movable_layouts().values(), ids=movable_layouts().keys())
@pytest.mark.parametrize("slots,moved", [PATTERNS["one"], PATTERNS["scattered"]], ids=["one", "scattered"])
def test_blocks_round_trip_byte_for_byte_on_the_simulated_device(blocks, slots, moved):
    assert_round_trip(blocks.raw, blocks.layers, slots, moved, targets=[(b + 1) % BLOCKS for b in moved[::-1]],
                      copies_of=_simulated)


@pytest.mark.parametrize("blocks", movable_layouts().values(), ids=movable_layouts().keys())
def test_blocks_round_trip_on_the_simulated_device_across_a_registrations_end(blocks):
    """The smallest registrations the pool allows, every block into consecutive slots across
    the end of the first: the device refuses a descriptor spanning two."""
    assert_round_trip(blocks.raw, blocks.layers, list(range(10, 10 + BLOCKS)), list(range(BLOCKS)),
                      targets=list(range(BLOCKS - 1, -1, -1)), copies_of=_simulated, chunk_bytes=1)


@pytest.mark.parametrize("name", sorted(TOKEN_MAJOR))
def test_a_token_major_block_is_refused_in_one_line_naming_its_shape_and_strides(name):
    blocks = Blocks(ORDERS[name], *CONTENTS["packed"])
    kv = blocks.layers()
    with pytest.raises(UsageError) as refused:
        BlockCopies(kv, blocks.host())
    message = str(refused.value)
    assert "\n" not in message and str(tuple(kv[0].shape)) in message and str(kv[0].stride()) in message
    assert "8 runs of 32 bytes" in message      # a run per token and head: 2 heads x 4 tokens, 16 bf16 each


def test_a_cpu_load_copies_each_layer_when_its_attention_asks():
    blocks = Blocks(ORDERS["LBHNC"], *CONTENTS["packed"])
    kv, host = blocks.layers(), blocks.host()
    copies = BlockCopies(kv, host)
    before = [t.clone() for t in kv]
    done = copies.load([4, 1], [0, 9])
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip(kv, before)) and not done.query()
    copies.wait_layer(1)
    assert torch.equal(bits(kv[1][[0, 9]]), bits(host.tensor[[4, 1], 1]))
    assert torch.equal(bits(kv[0]), bits(before[0])) and not done.query()
    copies.wait_layer(1)        # a layer waited on twice copies once
    copies.wait_loads()
    assert done.query() and all(torch.equal(bits(kv[layer][[0, 9]]), bits(host.tensor[[4, 1], layer]))
                                for layer in range(LAYERS))


def test_an_index_written_twice_in_one_call_is_refused():
    blocks = Blocks(ORDERS["LBHNC"], *CONTENTS["packed"])
    copies = BlockCopies(blocks.layers(), blocks.host())
    with pytest.raises(AssertionError, match="host slot 3 appears more than once"):
        copies.save([3, 5, 3], [0, 1, 2])
    with pytest.raises(AssertionError, match="block 2 appears more than once"):
        copies.load([0, 1], [2, 2])
    with pytest.raises(IndexError, match=r"blocks 0..12 outside 0..11"):
        copies.save([0, 1], [0, 12])


class _Calls(TorchDispatchMode):
    """Counts the tensor operations run under it that are not views: on CUDA, the launches."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _step_calls(blocks: Blocks, count: int) -> Counter[str]:
    """The operations of one step that loads `count` scattered blocks and saves as many."""
    copies = BlockCopies(blocks.layers(), blocks.host())
    slots, moved = list(range(0, 2 * count, 2)), list(range(2 * count - 1, 0, -2))   # neither side a run
    with _Calls() as mode:
        copies.load(slots, moved)
        for layer in range(LAYERS):
            copies.wait_layer(layer)
        copies.save(slots, moved)
    return mode.calls


def test_a_steps_copy_calls_do_not_grow_with_its_block_count():
    few = _step_calls(Blocks(ORDERS["LHBNC"], *CONTENTS["packed"]), 2)
    many = _step_calls(Blocks(ORDERS["LHBNC"], *CONTENTS["packed"]), BLOCKS // 2)
    assert few == many
    # per layer and direction one gather and one scatter through the stage
    assert few["aten.index_select.out"] == few["aten.index_copy_.default"] == 2 * LAYERS
    assert sum(few.values()) <= 4 * LAYERS + 8     # and per op its indices and its stage


def test_close_copies_the_layers_a_cpu_load_was_never_asked_for_and_a_fence_has_nothing_to_wait_for():
    blocks = Blocks(ORDERS["LBHNC"], *CONTENTS["packed"])
    kv, host = blocks.layers(), blocks.host()
    copies = BlockCopies(kv, host)
    done = copies.load([4, 1], [0, 9])
    copies.wait_layer(0)
    copies.fence_saves(0)           # a CPU save copies before it returns
    copies.close()
    copies.close()                  # once
    assert done.query() and all(torch.equal(bits(kv[layer][[0, 9]]), bits(host.tensor[[4, 1], layer]))
                                for layer in range(LAYERS))
