"""Strided copies of page runs, a group of layers at a time: how the CPU moves big slabs.

The index kernels copy a slab element by element; a copy of a strided view moves whole
rows at memcpy speed. A run is a stretch of consecutive source pages going to consecutive
destination pages, so a run's slabs over a span of layers are one strided view on either
side: one copy. The copies run in numpy (`np.copyto` on views of the pools): a call costs
about a microsecond where torch's `copy_` costs ten, numpy never forks threads of its own
(the copier runs two), and it releases the GIL while it copies. A span holds enough layers
for a copy to move `_PIECE_BYTES` (one layer when runs are long), and long runs are cut into
pieces of that size, so a group splits into enough copies for two threads to share evenly.
Events are set a group of layers at a time, a group moving at least `_GROUP_BYTES`, as the
two threads meet once per group. When even all the layers of an average run are under
`_RUN_BYTES`, the calls would cost more than the bytes and the index kernels win.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

_PIECE_BYTES = 512 << 10    # the most one copy moves: a group is many, shared by two threads
_RUN_BYTES = 32 << 10       # below this a run copy costs more than the index kernels
_GROUP_BYTES = 4 << 20      # the least a group of layers moves: the threads meet once per group

Piece = tuple[int, int, int]            # first source page, first destination page, pages
Copy = tuple[slice, int, int, int]      # a piece over a span of layers


@dataclass(frozen=True)
class RunPlan:
    """The op's runs cut into pieces; how many layers one copy spans, and how many layers
    complete together (a multiple of the span, or all of them)."""

    pieces: tuple[Piece, ...]
    span: int
    group: int

    @classmethod
    def of(cls, src_pages: list[int], dst_pages: list[int], layers: int, slab_bytes: int) -> RunPlan | None:
        """`slab_bytes`: one page of one layer. None when the runs are too short for copies
        to beat the index kernels."""
        runs = _runs(src_pages, dst_pages)
        if not runs:
            return cls((), layers, layers)
        run_bytes = slab_bytes * len(src_pages) // len(runs)        # one layer of an average run
        if run_bytes * layers < _RUN_BYTES:
            return None
        span = max(1, min(layers, _PIECE_BYTES // run_bytes))
        layer_bytes = slab_bytes * len(src_pages)
        group = min(layers, span * -(-_GROUP_BYTES // (span * layer_bytes)))
        step = max(1, _PIECE_BYTES // (span * slab_bytes))           # pages per piece
        return cls(tuple((s + i, d + i, min(step, n - i)) for s, d, n in runs for i in range(0, n, step)),
                   span, group)

    def copies(self, layers: range) -> list[Copy]:
        """A group's copies: every piece over each span of its layers."""
        spans = [slice(first, min(first + self.span, layers.stop))
                 for first in range(layers.start, layers.stop, self.span)]
        return [(span, *piece) for span in spans for piece in self.pieces]

    @staticmethod
    def move(src: np.ndarray, dst: np.ndarray, copies: deque[Copy]) -> None:
        """Pops copies until there are none left; threads that share the deque each pop
        different ones (a deque's pops are thread-safe). `src` and `dst` are either pool as
        (layers, pages, words), in numpy."""
        while True:
            try:
                layers, s, d, n = copies.popleft()
            except IndexError:
                return
            np.copyto(dst[layers, d:d + n], src[layers, s:s + n])


def _runs(src_pages: list[int], dst_pages: list[int]) -> list[Piece]:
    """Pairs in source order, merged while both sides stay consecutive."""
    runs: list[list[int]] = []
    for s, d in sorted(zip(src_pages, dst_pages)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]
