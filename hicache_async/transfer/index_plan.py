"""Index kernels over the page dimension: one gather or scatter moves a layer's slabs.

A page of a layer is one contiguous slab in both pools, so a layer of an op is one
`index_select` or `index_copy_` whatever the page pattern. The kernels copy a slab one
element at a time, which is slow for big slabs but costs one call per layer: the CPU's
copies use them where slabs are small (see `run_plan`), and BlockCopies' CPU branch for a
layer of a step's blocks. On a device every byte moves by DMA instead (`stream_copies`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Slabs move as the widest word that divides them: the index kernels copy one element at a
# time, so wider elements are fewer steps (complex128 copies bits exactly, like an integer).
WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)
_STAGE_BYTES = 16 << 20     # the most a layer stages at once, when neither side is a run


def slab_rows(pool: torch.Tensor, slab_bytes: int) -> torch.Tensor:
    """Layer-major (layers, pages, ...) -> (layers, pages, words): one row per slab, as the
    widest word that divides it. Views only: a copy would lose the writes."""
    word = next(w for w in WORDS if slab_bytes % w.itemsize == 0)
    layers, pages = pool.shape[:2]
    return pool.view(layers, pages, -1).view(word)


@dataclass(frozen=True)
class IndexPlan:
    """Which slabs one op moves, built once per op and replayed on every layer.

    When one side's pages, in some order of the pairs, are one consecutive run, a layer is
    one pass: a gather straight into the destination run, or a scatter straight from the
    source run. Otherwise it is a gather into `stage` and a scatter out of it, a stage's
    worth of pages at a time (a bounded stage: memory is the KV pool's).
    """

    src: torch.Tensor                 # source page of each slab
    dst: torch.Tensor                 # its destination page
    src_run: slice | None = None      # the sources are these pages in this order
    dst_run: slice | None = None      # the destinations are
    stage: torch.Tensor | None = None

    @classmethod
    def of(cls, src_pages: list[int], dst_pages: list[int], rows: torch.Tensor,
           stage_bytes: int | None = None) -> IndexPlan:
        """`rows`: one layer's (pages, ...) view of either pool, for its shape; a stage holds
        at most `stage_bytes` (`_STAGE_BYTES` unless given)."""
        by_dst, by_src = sorted(zip(dst_pages, src_pages)), sorted(zip(src_pages, dst_pages))
        dst_run, src_run = _run([d for d, _ in by_dst]), _run([s for s, _ in by_src])
        if dst_run is not None:
            return cls(_index([s for _, s in by_dst]), _index([]), dst_run=dst_run)
        if src_run is not None:
            return cls(_index([]), _index([d for _, d in by_src]), src_run=src_run)
        if not src_pages:
            return cls(_index([]), _index([]))
        pages = min(len(src_pages), max(1, (stage_bytes or _STAGE_BYTES) // (rows[0].numel() * rows.element_size())))
        stage = torch.empty((pages, *rows.shape[1:]), dtype=rows.dtype)
        return cls(_index(src_pages), _index(dst_pages), stage=stage)

    @property
    def dst_pages(self) -> slice | torch.Tensor:
        return self.dst_run if self.dst_run is not None else self.dst

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One layer: row p of `src` is page p's slab of that layer in the source pool."""
        if self.dst_run is not None:
            torch.index_select(src, 0, self.src, out=dst[self.dst_run])
        elif self.src_run is not None:
            dst.index_copy_(0, self.dst, src[self.src_run])
        elif self.stage is not None:
            size = len(self.stage)
            for s, d in zip(self.src.split(size), self.dst.split(size)):
                dst.index_copy_(0, d, torch.index_select(src, 0, s, out=self.stage[:len(s)]))


def _run(pages: list[int]) -> slice | None:
    """The pages as a slice if they are consecutive ascending pages (and at least one)."""
    if pages and pages == list(range(pages[0], pages[0] + len(pages))):
        return slice(pages[0], pages[0] + len(pages))
    return None


def _index(pages: list[int]) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.int64)
