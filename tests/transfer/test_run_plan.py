"""Run copies: consecutive page pairs merge into runs, cut into pieces small enough for two
threads to share a group; slabs too small for a call to pay go to the index kernels."""
import threading
from collections import deque

import numpy as np
import pytest

from hicache_async.transfer import run_plan
from hicache_async.transfer.run_plan import RunPlan

SLAB = 64 << 10     # bytes of one page of one layer


@pytest.fixture
def uncut(monkeypatch):
    """Calls big enough that no run is cut into pieces."""
    monkeypatch.setattr(run_plan, "_PIECE_BYTES", 1 << 40)


def test_pairs_consecutive_on_both_sides_merge_into_runs_in_source_order(uncut):
    plan = RunPlan.of([9, 4, 5, 6, 20, 1], [3, 30, 31, 32, 40, 0], 4, SLAB)
    assert plan.pieces == ((1, 0, 1), (4, 30, 3), (9, 3, 1), (20, 40, 1))


def test_a_page_that_breaks_either_side_starts_a_new_run(uncut):
    plan = RunPlan.of([0, 1, 2, 3], [10, 11, 13, 14], 4, SLAB)
    assert plan.pieces == ((0, 10, 2), (2, 13, 2))
    assert RunPlan.of([3, 3], [5, 6], 4, SLAB).pieces == ((3, 5, 1), (3, 6, 1))   # one source, two pages


@pytest.mark.parametrize("src,dst", [([0, 5, 9], [7, 2, 4]), (list(range(16)), list(range(16))),
                                     (list(range(40)), list(range(40, 0, -1)))])
def test_a_copy_pays_for_its_call_and_stays_on_its_thread_and_a_group_moves_enough(src, dst):
    plan = RunPlan.of(src, dst, 32, SLAB)
    for layers, _, _, pages in plan.copies(range(0, plan.group)):
        assert (layers.stop - layers.start) * pages * SLAB <= run_plan._PIECE_BYTES
    assert plan.span * SLAB * len(src) // len(plan.pieces) >= run_plan._PIECE_BYTES or plan.span == 32
    assert plan.group % plan.span == 0 or plan.group == 32
    assert plan.group * SLAB * len(src) >= run_plan._GROUP_BYTES or plan.group == 32
    assert sorted(s + i for s, _, n in plan.pieces for i in range(n)) == sorted(src)


def test_a_group_is_every_piece_over_each_span_of_its_layers():
    plan = RunPlan(((0, 5, 2), (4, 0, 1)), span=2, group=5)
    assert plan.copies(range(5, 10)) == [(slice(5, 7), 0, 5, 2), (slice(5, 7), 4, 0, 1), (slice(7, 9), 0, 5, 2),
                                         (slice(7, 9), 4, 0, 1), (slice(9, 10), 0, 5, 2), (slice(9, 10), 4, 0, 1)]


def test_small_slabs_go_to_the_index_kernels():
    assert RunPlan.of([0, 5, 9], [7, 2, 4], 2, 256) is None           # 512 bytes a run, all layers
    assert RunPlan.of(list(range(64)), list(range(64)), 2, 256) is not None   # one long run pays


def test_a_move_copies_exactly_the_copies_it_takes():
    src, dst = np.random.default_rng(0).standard_normal((4, 8, 6)), np.zeros((4, 8, 6), dtype=np.float64)
    copies = deque([(slice(0, 3), 0, 5, 2), (slice(3, 4), 4, 0, 1)])
    RunPlan.move(src, dst, copies)
    assert np.array_equal(dst[:3, 5:7], src[:3, 0:2]) and np.array_equal(dst[3, 0], src[3, 4])
    dst[:3, 5:7] = 0
    dst[3, 0] = 0
    assert not dst.any()                    # nothing else written
    assert not copies                       # drained: a sharing thread finds nothing left


def test_threads_sharing_a_groups_copies_take_each_exactly_once():
    """Each thread moves into a destination of its own: every page lands in exactly one."""
    pages = 20_000
    src = np.arange(1, pages + 1, dtype=np.float64).reshape(1, pages, 1)
    dsts = (np.zeros_like(src), np.zeros_like(src))
    shared = deque((slice(0, 1), i, i, 1) for i in range(pages))
    threads = [threading.Thread(target=RunPlan.move, args=(src, dst, shared)) for dst in dsts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert ((dsts[0] != 0) ^ (dsts[1] != 0)).all()
    assert np.array_equal(dsts[0] + dsts[1], src)
    assert not shared
