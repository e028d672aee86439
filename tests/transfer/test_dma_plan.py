"""The DMA plan on CPU: its descriptors (pointers, sizes, runs joined where both sides continue,
cut where the host pool's registrations meet), and every layout's round trip through it,
executed by plain memory moves, against the same per-block references as BlockCopies."""
from __future__ import annotations

import math
import mmap

import numpy as np
import pytest
import torch

from hicache_async import pools
from hicache_async.events import HostEvent
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.transfer.dma import memmove
from hicache_async.transfer.dma_plan import Descriptors, DmaPlan, block_runs, coalesced, split
from tests.helpers.block_round_trips import BLOCKS, CONTENTS, ORDERS, Blocks, assert_round_trip, movable_layouts

PATTERNS = {
    "one": ([7], [3]),
    "runs": ([2, 3, 4], [5, 6, 7]),
    "scattered": ([9, 0, 4, 6], [11, 2, 8, 5]),
    "a run to scattered": ([3, 4, 5, 6], [10, 1, 7, 0]),
    "every block, reversed": (list(range(BLOCKS)), list(range(BLOCKS - 1, -1, -1))),
    "every block across a registration's end": (list(range(10, 10 + BLOCKS)), list(range(BLOCKS))),
}
WIDE = (2, 256)     # heads, content: a page of 3 layers is 12 KiB, whole memory pages, so a registration may be one


class MemmoveCopies:
    """A DMA plan executed by memmove, as StreamCopies executes it on CUDA: a load a batch a
    layer, a save one batch over every layer."""

    def __init__(self, kv: list[torch.Tensor], host: HostPool) -> None:
        self.plan = DmaPlan(kv, [block_runs(layer, t) for layer, t in enumerate(kv)], host)

    def save(self, slots: list[int], blocks: list[int]) -> HostEvent:
        memmove(self.plan.whole(slots, blocks, load=False))
        return _done()

    def load(self, slots: list[int], blocks: list[int]) -> HostEvent:
        for copy in self.plan.layers(slots, blocks, load=True):
            memmove(copy)
        return _done()

    def wait_loads(self) -> None:
        pass

    def close(self) -> None:
        pass


def _done() -> HostEvent:
    done = HostEvent()
    done.set()
    return done


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one registration", "the smallest registrations"])
@pytest.mark.parametrize("blocks", movable_layouts().values(), ids=movable_layouts().keys())
@pytest.mark.parametrize("slots,moved", PATTERNS.values(), ids=PATTERNS.keys())
def test_every_layout_round_trips_through_the_plan_byte_for_byte(blocks, slots, moved, chunk_bytes):
    """The smallest registrations are 16 pages of these layouts (12 KiB; an MLA page of 288
    bytes makes one registration of the pool): joined runs across their ends are cut."""
    assert_round_trip(blocks.raw, blocks.layers, slots, moved, targets=[(b + 1) % BLOCKS for b in moved[::-1]],
                      copies_of=MemmoveCopies, chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("pages_a_chunk", [1, 2])
@pytest.mark.parametrize("name", ["BLHNC", "LBHNC", "LHBNC"])
def test_pages_of_whole_memory_pages_round_trip_through_registrations_of_a_page_or_two(name, pages_a_chunk):
    blocks = Blocks(ORDERS[name], *WIDE)
    every = list(range(BLOCKS))
    assert_round_trip(blocks.raw, blocks.layers, every, every, targets=every[::-1], copies_of=MemmoveCopies,
                      chunk_bytes=pages_a_chunk * blocks.host().layout.page_bytes)


def _plan(name: str, chunk_bytes: int | None = None, content: tuple[int, int] = CONTENTS["packed"]
          ) -> tuple[list[torch.Tensor], HostPool, DmaPlan]:
    blocks = Blocks(ORDERS[name], *content)
    kv = blocks.layers()
    host = HostPool(blocks.host().layout, 2 * BLOCKS, chunk_bytes=chunk_bytes)
    return kv, host, DmaPlan(kv, [block_runs(layer, t) for layer, t in enumerate(kv)], host)


def _rows(copy: Descriptors) -> list[tuple[int, int, int]]:
    return list(zip(copy.src.tolist(), copy.dst.tolist(), copy.size.tolist()))


def test_a_load_is_a_descriptor_a_block_of_each_layer_from_its_pages_share():
    kv, host, plan = _plan("LBHNC")
    layers = list(plan.layers([4, 2, 3], [7, 5, 6], load=True))
    assert len(layers) == 3
    block = kv[0][0].numel() * 2        # 2 heads x 4 tokens x 16 bf16: one run
    for layer, copy in enumerate(layers):
        # in slot order; the blocks continue in the layer but the pages' shares do not: no joins
        assert _rows(copy) == [(host.tensor[s, layer].data_ptr(), kv[layer][b].data_ptr(), block)
                               for s, b in ((2, 5), (3, 6), (4, 7))]
        assert copy.src.dtype == copy.dst.dtype == copy.size.dtype == np.int64


def test_a_save_of_a_block_a_run_per_head_is_a_descriptor_a_head():
    kv, host, plan = _plan("LHBNC")
    copy = plan.whole([6], [9], load=False)
    head = kv[0][0, 0].numel() * 2
    assert _rows(copy) == [(kv[layer][9, h].data_ptr(), host.tensor[6, layer, h].data_ptr(), head)
                           for layer in range(3) for h in range(2)]


@pytest.mark.parametrize("pages_a_chunk,pieces", [(None, [(2, 5, 3)]), (2, [(2, 5, 2), (4, 7, 1)]),
                                                  (1, [(2, 5, 1), (3, 6, 1), (4, 7, 1)])])
def test_a_save_joins_pages_that_continue_on_both_sides_and_cuts_them_where_registrations_meet(
        pages_a_chunk, pieces):
    """BLHNC: a block of every layer is one run, byte for byte a page: consecutive blocks into
    consecutive slots are one descriptor, cut at every boundary of the pool's registrations."""
    page = 3 * 2 * 4 * 256 * 2
    kv, host, plan = _plan("BLHNC", pages_a_chunk and pages_a_chunk * page, WIDE)
    assert host.chunk_bytes == (pages_a_chunk or (1 << 30) // page) * page
    copy = plan.whole([3, 4, 2], [6, 7, 5], load=False)
    assert _rows(copy) == [(kv[0][b].data_ptr(), host.tensor[s].data_ptr(), n * page) for s, b, n in pieces]


def test_a_load_never_joins_across_layers_and_a_padded_block_never_joins_the_next():
    kv, host, plan = _plan("BLHNC")
    assert [len(copy) for copy in plan.layers([2, 3], [5, 6], load=True)] == [2, 2, 2]
    padded = Blocks(ORDERS["BLHNC"], 2, 16, pad=3)
    kv = padded.layers()
    plan = DmaPlan(kv, [block_runs(layer, t) for layer, t in enumerate(kv)], padded.host())
    assert len(plan.whole([2, 3, 4], [5, 6, 7], load=False)) == 3      # a page each: the padding breaks the run


def test_coalesced_joins_only_where_both_sides_continue():
    copy = Descriptors(np.array([0, 10, 20, 50, 60]), np.array([100, 110, 130, 140, 150]), np.array([10] * 5))
    assert _rows(coalesced(copy)) == [(0, 100, 20), (20, 130, 10), (50, 140, 20)]
    assert coalesced(Descriptors(*(np.array([], dtype=np.int64),) * 3)).size.size == 0


@pytest.mark.parametrize("host_is_src", [True, False])
def test_split_cuts_the_host_range_at_every_chunk_boundary(host_is_src):
    host, device = np.array([1000, 1050]), np.array([100, 300])
    src, dst = (host, device) if host_is_src else (device, host)
    copy = split(Descriptors(src, dst, np.array([50, 5])), host_is_src=host_is_src, chunks=(990, 20))
    pieces = [(1000, 100, 10), (1010, 110, 20), (1030, 130, 20), (1050, 300, 5)]     # boundaries 1010, 1030, 1050
    assert _rows(copy) == [(h, d, n) if host_is_src else (d, h, n) for h, d, n in pieces]


def test_a_pool_registers_whole_pages_of_whole_memory_pages_as_injected_or_as_the_module_says(monkeypatch):
    layout = KVLayout(num_layers=2, kv_heads=1, head_dim=8, page_size=4, dtype=torch.float16)
    unit = math.lcm(layout.page_bytes, mmap.PAGESIZE)       # two registrations never share a memory page
    assert unit % layout.page_bytes == 0 and unit > layout.page_bytes
    assert HostPool(layout, 64, chunk_bytes=2 * unit + unit // 2).chunk_bytes == 2 * unit
    assert HostPool(layout, 64, chunk_bytes=layout.page_bytes).chunk_bytes == unit        # at least one
    monkeypatch.setattr(pools, "PIN_CHUNK_BYTES", 3 * unit)
    assert HostPool(layout, 64).chunk_bytes == 3 * unit
    given = HostPool(layout, 8, tensor=torch.zeros((8, 2, *layout.layer_page_shape), dtype=torch.float16))
    assert given.chunk_bytes == 8 * layout.page_bytes                        # an engine's buffer: one chunk
