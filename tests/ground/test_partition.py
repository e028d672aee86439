"""cp_page_slice: properties any correct split has, and tables worked out by hand."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_async.partition import cp_page_slice


@given(st.integers(0, 500), st.integers(1, 16))
def test_ranks_in_order_cover_every_page_once_in_contiguous_blocks(n, c):
    slices = [cp_page_slice(n, r, c) for r in range(c)]
    assert [p for s in slices for p in s] == list(range(n))
    assert all(s.step == 1 for s in slices)


@given(st.integers(0, 500), st.integers(1, 16))
def test_blocks_are_balanced_and_larger_ones_come_first(n, c):
    sizes = [len(cp_page_slice(n, r, c)) for r in range(c)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n,c,expected", [
    (10, 4, [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]),
    (3, 5, [range(0, 1), range(1, 2), range(2, 3), range(3, 3), range(3, 3)]),
    (8, 2, [range(0, 4), range(4, 8)]),
    (7, 1, [range(0, 7)]),
    (0, 3, [range(0, 0)] * 3),
])
def test_hand_worked_splits(n, c, expected):
    assert [cp_page_slice(n, r, c) for r in range(c)] == expected


@pytest.mark.parametrize("args,name", [((-1, 0, 1), "num_pages"), ((4, 2, 2), "cp_rank"),
                                       ((4, -1, 2), "cp_rank"), ((4, 0, 0), "cp_size")])
def test_bad_arguments_are_named(args, name):
    with pytest.raises(ValueError, match=name):
        cp_page_slice(*args)
