"""The index kernels: each layer of an op is one gather or scatter, or a gather and a scatter
through a bounded stage."""
import pytest
import torch

from hicache_async.transfer import index_plan
from hicache_async.transfer.index_plan import IndexPlan
from tests.helpers.page_patterns import LAYOUTS, PATTERNS, assert_round_trip

ROWS = torch.zeros(16, 4)     # one layer of a pool: 16 pages, slabs of 4 words


def test_a_layer_is_one_pass_when_either_side_is_a_run():
    gather = IndexPlan.of([4, 9, 2], [7, 5, 6], ROWS)
    assert gather.dst_run == slice(5, 8) and gather.src.tolist() == [9, 2, 4] and gather.stage is None
    scatter = IndexPlan.of([7, 5, 6], [4, 9, 2], ROWS)
    assert scatter.src_run == slice(5, 8) and scatter.dst.tolist() == [9, 2, 4] and scatter.stage is None


@pytest.mark.parametrize("src,dst", [([1, 3], [5, 7]), ([1, 2, 9], [5, 5, 6]), ([1, 1, 4], [2, 9, 3])])
def test_a_layer_is_staged_when_neither_side_is_a_run(src, dst):
    plan = IndexPlan.of(src, dst, ROWS)
    assert plan.src_run is None and plan.dst_run is None
    assert plan.src.tolist() == src and plan.dst.tolist() == dst and plan.stage.shape == (len(src), 4)


@pytest.mark.parametrize("name", ["wide", "odd"])
def test_a_stage_smaller_than_the_op_moves_it_a_stage_at_a_time(name, monkeypatch):
    layout = LAYOUTS[name]      # slabs small enough that the CPU copier uses the index kernels
    monkeypatch.setattr(index_plan, "_STAGE_BYTES", 2 * layout.layer_page_bytes)
    rows = torch.zeros(16, layout.layer_page_bytes, dtype=torch.uint8)
    assert len(IndexPlan.of([1, 3, 8], [5, 0, 7], rows).stage) == 2
    assert_round_trip(layout, *PATTERNS["random"], device="cpu")      # 9 pages, 2 at a time
