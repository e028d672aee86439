"""Device (L1) and host (L2) KV pools, each a tensor of pages plus a free-page allocator."""
from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import weakref

import torch

from .errors import PoolExhausted, UsageError
from .layout import KVLayout

PIN_CHUNK_BYTES = 1 << 30
"""The most one cudaHostRegister call page-locks, rounded down to whole pages: a DMA whose host
range spans two registrations is refused, so a page must never straddle one."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes from a tensor's first element to its last (all of them when it is contiguous),
    without a copy; the caller keeps `t` alive."""
    span = 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride())) if t.numel() else 0
    return memoryview((ctypes.c_ubyte * (span * t.element_size())).from_address(t.data_ptr()))


def byte_runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of bytes a tensor's elements lie in, in element order: (offset from its first
    element, bytes) each; one run when it is contiguous. The innermost axes laid out back to
    back make one run; the axes outside them say where each run starts."""
    dims = [(n, step) for n, step in zip(t.shape, t.stride()) if n != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = torch.zeros((), dtype=torch.int64)
    for n, step in dims:
        starts = starts.unsqueeze(-1) + torch.arange(n) * step
    size = t.element_size()
    return [(at * size, run * size) for at in starts.flatten().tolist()]


class PageAllocator:
    """Free list of page indices; says clearly which tier ran out and by how much."""

    def __init__(self, num_pages: int, tier: str) -> None:
        if num_pages <= 0:
            raise UsageError(f"{tier} pool needs a positive page count, got {num_pages}")
        self.num_pages = num_pages
        self.tier = tier
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.tier} pool exhausted: need {n} pages, {len(self._free)} free "
                                f"of {self.num_pages}")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        if len(self._free) > self.num_pages:
            raise AssertionError(f"{self.tier} pool: double free ({len(self._free)} > {self.num_pages})")


class DevicePool:
    """L1: layer-major so a forward pass reads one layer's pages as one slab.

    `tensor[layer, page]` has shape `layout.layer_page_shape` = (planes, page_size, heads, dim).
    """

    tier = "device"

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.alloc = PageAllocator(num_pages, self.tier)
        self.tensor = torch.zeros((layout.num_layers, num_pages, *layout.layer_page_shape),
                                  dtype=layout.dtype, device=device)

    @property
    def num_pages(self) -> int:
        return self.alloc.num_pages


class HostPool:
    """L2: page-major so one page of every local layer is one contiguous run of bytes.

    That is what storage objects and zero-copy batch calls want. `tensor[page, layer]` has
    shape `layout.layer_page_shape`. Pinned when CUDA is present, for the copy engines' DMA
    (which takes its pages' host addresses as they are), a registration (`chunk_bytes`, whole
    pages) at a time; `close()` unpins it.
    """

    tier = "host"

    def __init__(self, layout: KVLayout, num_pages: int, tensor: torch.Tensor | None = None,
                 chunk_bytes: int | None = None) -> None:
        """A pool of `num_pages` of its own, or over an engine's host buffer: `tensor`, a view
        shaped (pages, layers, *layout.layer_page_shape), strided where the engine's pages are
        not one run of bytes (then storage moves a page as its runs, or through staging where
        they are many and small). A whole-page object holds the page's bytes in our order, or
        in memory order where the store names this pool's `page_order`: a page_first page is a
        K and a V run in memory, against a run a token and layer in ours. `chunk_bytes`: the
        most one registration pins (`PIN_CHUNK_BYTES` unless given), rounded down (to at least
        one) to whole pages that are whole memory pages too; the chunks exist on CPU too, where
        nothing is pinned, so DMA plans split alike."""
        self.layout = layout
        self.alloc = PageAllocator(num_pages, self.tier)
        shape = (num_pages, layout.num_layers, *layout.layer_page_shape)
        unit = math.lcm(layout.page_bytes, mmap.PAGESIZE)
        self.chunk_bytes = max(1, (chunk_bytes or PIN_CHUNK_BYTES) // unit) * unit
        """Registrations start at the pool's first byte and every `chunk_bytes` after it, each
        whole pages and whole pages of memory (two registrations sharing a memory page would
        overlap); one chunk spans a pool over an engine's buffer, which is not pinned here."""
        self._unpin = None
        if tensor is None and torch.cuda.is_available():
            tensor, self._unpin = _pinned_zeros(shape, layout.dtype, self.chunk_bytes)
        elif tensor is None:
            tensor = torch.zeros(shape, dtype=layout.dtype)
        elif tuple(tensor.shape) != shape or tensor.dtype != layout.dtype:
            raise UsageError(f"host buffer is {tuple(tensor.shape)} {tensor.dtype}, the layout needs {shape} "
                             f"{layout.dtype}")
        else:
            self.chunk_bytes = len(tensor_bytes(tensor)) or 1
        self.tensor = tensor
        self.runs = _merged(byte_runs(tensor[0]))
        """Where each page's bytes lie, in our order (layer by layer, each in `layout.axes`
        order): (offset from the page's first byte, bytes)."""
        memory = _merged(sorted(self.runs))
        by_stride = sorted(range(tensor.dim() - 1), key=lambda d: -tensor.stride(d + 1))
        in_memory = len(memory) < len(self.runs) and _merged(byte_runs(tensor[0].permute(by_stride))) == memory
        self.page_order = _order_digest(self.runs) if in_memory else ""
        """Names the page's memory order where it takes fewer runs than ours (`page_first`: a K and
        a V run against one a token and layer) and is an order of its axes, else "": a store whose
        `layout.page_order` is this one holds whole pages in memory order (`stored_runs`)."""
        self.memory_runs = memory
        self._by_stride = by_stride

    def close(self) -> None:
        """Unpins a pool pinned here, once: no copy may use it after."""
        if self._unpin is not None:
            self._unpin()

    def stored_runs(self, page_order: str) -> list[tuple[int, int]]:
        """Where the bytes of a whole-page object lie, in the object's order: memory order when
        `page_order` (a store's) names this pool's, ours when it is ""."""
        self._check(page_order)
        return self.memory_runs if page_order else self.runs

    def stored_page(self, page: int, page_order: str) -> torch.Tensor:
        """A whole page as a view whose elements run in its object's order (`stored_runs`)."""
        self._check(page_order)
        return self.tensor[page].permute(self._by_stride) if page_order else self.tensor[page]

    def _check(self, page_order: str) -> None:
        """Any order but ours and this pool's is another buffer's, whose objects this pool
        cannot lay out."""
        if page_order and page_order != self.page_order:
            raise UsageError(f"the store keeps whole pages in byte order {page_order}, this host pool's is "
                             f"{self.page_order or 'ours'}: build the store with this pool")

    def page_bytes(self, page: int) -> memoryview:
        """The page's bytes, without a copy."""
        return tensor_bytes(self.tensor[page])

    def page_ptr(self, page: int) -> int:
        return self.tensor[page].data_ptr()


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Runs in their order, each joined to the one before where it starts as that one ends."""
    out: list[tuple[int, int]] = []
    for at, n in runs:
        if out and sum(out[-1]) == at:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((at, n))
    return out


def _order_digest(runs: list[tuple[int, int]]) -> str:
    """A digest of the order memory holds a page's bytes in, given its runs in our order: where
    each stretch of memory order starts in ours and its length, stretches that continue in both
    joined, so one permutation of the bytes has one digest whatever the buffer's gaps."""
    ours, at = [], 0
    for start, n in runs:
        ours.append((start, at, n))
        at += n
    stretches = _merged([(at, n) for _, at, n in sorted(ours)])
    return hashlib.sha256(repr(stretches).encode()).hexdigest()[:16]


def _pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype, chunk: int) -> tuple[torch.Tensor, weakref.finalize]:
    """Zeroed host memory of exactly `shape`, page-locked `chunk` bytes at a time, and the call
    that unlocks it (run at the latest when the tensor goes). torch's pinned allocator would
    round the pool up to a power of two: a 33 GiB pool would lock 64. An anonymous mapping is
    page-aligned, so chunks never share a page, and zero until written."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
    chunks: list[int] = []
    unpin = weakref.finalize(tensor, _unregister, chunks, buffer)    # keeps the mapping until unlocked
    unpin.atexit = False        # the process's exit releases it; CUDA may be gone by then
    cudart = torch.cuda.cudart()
    for at in range(0, nbytes, chunk):
        size = min(chunk, nbytes - at)
        error = int(cudart.cudaHostRegister(tensor.data_ptr() + at, size, 3))     # portable | mapped
        if error:
            unpin()
            raise UsageError(f"could not pin {size} bytes of the {nbytes}-byte host pool (cudaHostRegister: CUDA "
                             f"error {error}): fewer host pages, or a higher locked-memory limit")
        chunks.append(tensor.data_ptr() + at)
    return tensor, unpin


def _unregister(chunks: list[int], buffer: mmap.mmap) -> None:
    """Best effort: a chunk's error changes nothing, the mapping goes with `buffer`."""
    cudart = torch.cuda.cudart()
    for ptr in chunks:
        cudart.cudaHostUnregister(ptr)
