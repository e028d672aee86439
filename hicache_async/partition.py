"""Which pages of a transfer a context-parallel rank moves."""
from __future__ import annotations

from .topology import split_range


def cp_page_slice(num_pages: int, cp_rank: int, cp_size: int) -> range:
    """Contiguous block of `num_pages` for `cp_rank` of `cp_size`; the remainder goes to the lowest ranks.

    Rank r gets `n // c` pages, plus one if `r < n % c`, starting at `r * (n // c) + min(r, n % c)`.
    The blocks are disjoint and their union is every page.
    """
    if num_pages < 0:
        raise ValueError(f"num_pages must be >= 0, got {num_pages}")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return split_range(num_pages, cp_size, cp_rank)
