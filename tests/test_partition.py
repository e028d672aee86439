import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_async.partition import cp_page_slice


@given(st.integers(0, 500), st.integers(1, 16))
def test_slices_are_contiguous_disjoint_and_cover_everything(n, c):
    slices = [cp_page_slice(n, r, c) for r in range(c)]
    assert [p for s in slices for p in s] == list(range(n))
    assert all(s.step == 1 for s in slices)


@given(st.integers(0, 500), st.integers(1, 16))
def test_remainder_goes_to_the_lowest_ranks(n, c):
    sizes = [len(cp_page_slice(n, r, c)) for r in range(c)]
    base, extra = divmod(n, c)
    assert sizes == [base + 1] * extra + [base] * (c - extra)
    for r in range(c):
        assert cp_page_slice(n, r, c).start == r * base + min(r, extra)


@pytest.mark.parametrize("args,name", [((-1, 0, 1), "num_pages"), ((4, 2, 2), "cp_rank"),
                                       ((4, -1, 2), "cp_rank"), ((4, 0, 0), "cp_size")])
def test_bad_arguments_are_named(args, name):
    with pytest.raises(ValueError, match=name):
        cp_page_slice(*args)
