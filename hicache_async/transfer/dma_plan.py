"""A copy of engine KV blocks to or from host pool pages as DMA descriptors: (source address,
destination address, bytes), ready for a batched copy call.

A block of a layer lies in one run of bytes or in one run a head (`block_runs`); its host
page's share of that layer is one run, the block's runs back to back. The addresses of every
run of a copy come from a few array operations over (layers, blocks, runs), never a Python
step per descriptor: a batched copy costs the driver about half a microsecond a descriptor,
so runs that continue on both sides are joined into one. A run is then cut where the host
pool's registrations meet (`HostPool.chunk_bytes`): a DMA whose host range spans two
`cudaHostRegister` calls is refused.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from ..errors import UsageError
from ..pools import HostPool

Runs = tuple[tuple[int, ...], tuple[int, ...], int]     # outer sizes, their strides, elements a run


class Descriptors(NamedTuple):
    """One batch of copies: int64 byte addresses and sizes, contiguous, as a driver takes them."""

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.size)


class DmaPlan:
    """Where every layer's block and its host page's share lie, in bytes; built once, then each
    copy's descriptors come from its (slot, block) pairs."""

    def __init__(self, kv: list[torch.Tensor], runs: list[Runs], host: HostPool) -> None:
        """`kv`: per layer, the logical [blocks, heads, tokens, content] view; `runs`: each
        layer's `block_runs` (the same sizes for all)."""
        pages, size = host.tensor, kv[0].element_size()
        if not pages[0, 0].is_contiguous():
            raise UsageError(f"host pool {tuple(pages.shape)} with strides {pages.stride()}: a page's share of a "
                             "layer must be one run of bytes")
        self.run_bytes = runs[0][2] * size
        offsets = np.stack([_run_offsets(sizes, strides) for sizes, strides, _ in runs]) * size    # (layers, runs)
        self._device = np.array([t.data_ptr() for t in kv], dtype=np.int64)[:, None] + offsets
        self._block_step = np.array([t.stride(0) * size for t in kv], dtype=np.int64)
        layers, count = offsets.shape
        self._host = (pages.data_ptr() + np.arange(layers, dtype=np.int64)[:, None] * pages.stride(1) * size
                      + np.arange(count, dtype=np.int64) * self.run_bytes)
        self._page_step = pages.stride(0) * size
        self._chunks = (pages.data_ptr(), host.chunk_bytes)

    def layers(self, slots: list[int], blocks: list[int], load: bool) -> Iterator[Descriptors]:
        """Each layer's descriptors in turn: a load lands a layer at a time."""
        device, host = self._addresses(slots, blocks)
        for layer in range(len(device)):
            yield self._descriptors(device[layer].ravel(), host[layer].ravel(), load)

    def whole(self, slots: list[int], blocks: list[int], load: bool) -> Descriptors:
        """Every layer's descriptors in one batch, a pair's layers next to each other: where a
        block of every layer is one run (vLLM's BLHNC), a page is one descriptor."""
        device, host = self._addresses(slots, blocks)
        return self._descriptors(device.transpose(1, 0, 2).ravel(), host.transpose(1, 0, 2).ravel(), load)

    def _addresses(self, slots: list[int], blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The (layers, pairs, runs) start addresses of every run on each side, the pairs in
        slot order so that consecutive slots may join."""
        order = np.argsort(np.asarray(slots, dtype=np.int64), kind="stable")
        slot = np.asarray(slots, dtype=np.int64)[order]
        block = np.asarray(blocks, dtype=np.int64)[order]
        device = self._device[:, None, :] + block[None, :, None] * self._block_step[:, None, None]
        host = self._host[:, None, :] + slot[None, :, None] * self._page_step
        return device, host

    def _descriptors(self, device: np.ndarray, host: np.ndarray, load: bool) -> Descriptors:
        size = np.full(len(device), self.run_bytes, dtype=np.int64)
        src, dst = (host, device) if load else (device, host)
        return split(coalesced(Descriptors(src, dst, size)), host_is_src=load, chunks=self._chunks)


def block_runs(layer: int, t: torch.Tensor) -> Runs:
    """A block of the layer as runs of elements: the sizes and strides of the axes outside a run,
    and a run's length. Refuses a block of more runs than heads."""
    dims: list[list[int]] = []
    for n, step in reversed([d for d in zip(t.shape[1:], t.stride()[1:]) if d[0] != 1]):
        if dims and dims[-1][0] * dims[-1][1] == step:     # lies right after the axis inside it
            dims[-1][0] *= n
        else:
            dims.append([n, step])
    run = dims.pop(0)[0] if dims and dims[0][1] == 1 else 1
    outer = dims[::-1]
    count = math.prod(n for n, _ in outer)
    if count > max(1, t.shape[1]):
        raise UsageError(f"KV cache layer {layer} is {tuple(t.shape)} with strides {t.stride()}: a block is "
                         f"{count} runs of {run * t.element_size()} bytes, more than one a head; the "
                         f"connector needs each head's tokens back to back (vLLM's LBHNC layout)")
    return tuple(n for n, _ in outer), tuple(s for _, s in outer), run


def coalesced(copy: Descriptors) -> Descriptors:
    """Each descriptor joined to the one before where both its source and its destination start
    where that one's end."""
    src, dst, size = copy
    if len(size) < 2:
        return copy
    joins = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    if not joins.any():
        return copy
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return Descriptors(src[starts], dst[starts], np.add.reduceat(size, starts))


def split(copy: Descriptors, host_is_src: bool, chunks: tuple[int, int]) -> Descriptors:
    """Each descriptor cut where its host range crosses from one registration into the next;
    `chunks`: (the first registration's address, the bytes each covers)."""
    base, chunk = chunks
    src, dst, size = copy
    host = src if host_is_src else dst
    first = (host - base) // chunk
    pieces = (host + size - 1 - base) // chunk - first + 1
    if len(size) == 0 or pieces.max() == 1:
        return copy
    which = np.repeat(np.arange(len(size)), pieces)
    nth = np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)     # piece within its descriptor
    bounds = base + (first[which] + nth) * chunk
    start = np.maximum(host[which], bounds)
    end = np.minimum(host[which] + size[which], bounds + chunk)
    shift = start - host[which]
    return Descriptors(src[which] + shift, dst[which] + shift, end - start)


def _run_offsets(sizes: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """Where each run of a block starts, in elements from the block's first, in the block's
    logical order (the order the host page holds them in)."""
    offsets = np.zeros(1, dtype=np.int64)
    for n, step in zip(sizes, strides):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * step).ravel()
    return offsets
