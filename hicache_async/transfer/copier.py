"""Moves pages between the device pool (L1) and the host pool (L2), one event per layer.

Each layer of an op is one gather or scatter over the page dimension, whatever the page
pattern: a page of a layer is one contiguous slab in both pools, so the index kernels copy
whole slabs. On CUDA the kernels run on dedicated copy streams, read and write the pinned
host pool in place (unified addressing), and complete on `torch.cuda.Event`s; on CPU a
single worker thread does them in FIFO order and sets host-side events. Either way the
caller gets the same per-layer events and goes through the same ack queues.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import HiCacheError
from . import faults
from .events import CompletionEvent, CudaEvent, HostEvent
from .pool import DevicePool, HostPool

# Slabs move as the widest word that divides them: the index kernels copy one element at a
# time, so wider elements are fewer steps (complex128 copies bits exactly, like an integer).
_WORDS = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)
_STAGE_BYTES = 16 << 20     # the most a layer stages at once, when neither side is a run


class CopyFailed(HiCacheError):
    """A layer copy raised: its op's events complete with this error instead of hanging."""


@dataclass(frozen=True)
class PagePlan:
    """Which slabs one op moves, built once per op and replayed on every layer.

    When one side's pages, in some order of the pairs, are one consecutive run, a layer is
    one pass: a gather straight into the destination run, or a scatter straight from the
    source run. Otherwise it is a gather into `stage` and a scatter out of it, a stage's
    worth of pages at a time (a bounded stage: device memory is the KV pool's).
    """

    src: torch.Tensor                 # source page of each slab
    dst: torch.Tensor                 # its destination page
    src_run: slice | None = None      # the sources are these pages in this order
    dst_run: slice | None = None      # the destinations are
    stage: torch.Tensor | None = None

    @classmethod
    def of(cls, src_pages: list[int], dst_pages: list[int], rows: torch.Tensor) -> PagePlan:
        """`rows`: one layer's (pages, words) view of either pool, for device and shape."""
        by_dst, by_src = sorted(zip(dst_pages, src_pages)), sorted(zip(src_pages, dst_pages))
        dst_run, src_run = _run([d for d, _ in by_dst]), _run([s for s, _ in by_src])
        if dst_run is not None:
            return cls(_index([s for _, s in by_dst], rows), _index([], rows), dst_run=dst_run)
        if src_run is not None:
            return cls(_index([], rows), _index([d for _, d in by_src], rows), src_run=src_run)
        if not src_pages:
            return cls(_index([], rows), _index([], rows))
        pages = min(len(src_pages), max(1, _STAGE_BYTES // (rows.shape[1] * rows.element_size())))
        stage = torch.empty((pages, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        return cls(_index(src_pages, rows), _index(dst_pages, rows), stage=stage)

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


def _index(pages: list[int], rows: torch.Tensor) -> torch.Tensor:
    """Page indices on the rows' device; on CUDA the copy is queued on the current stream."""
    cpu = torch.tensor(pages, dtype=torch.int64, pin_memory=rows.is_cuda)
    return cpu.to(rows.device, non_blocking=True)


class Copier:
    def __init__(self, device: DevicePool, host: HostPool) -> None:
        self.device, self.host = device, host
        self.layers = device.layout.num_layers
        self.cuda = device.tensor.is_cuda
        self.fault = faults.injected()
        word = next(w for w in _WORDS if device.layout.layer_page_bytes % w.itemsize == 0)
        host_tensor = _mapped(host.tensor, device.tensor.device) if self.cuda else host.tensor
        # Per layer, a (pages, words) view: page p of layer l is row p.
        self._slabs = {"device": _rows(device.tensor, word).unbind(0),
                       "host": _rows(host_tensor.transpose(0, 1), word).unbind(0)}
        if self.cuda:
            self._streams = {"write": torch.cuda.Stream(), "load": torch.cuda.Stream()}
        else:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")

    def write(self, device_pages: list[int], host_pages: list[int]) -> list[CompletionEvent]:
        """Device -> host. Returns one event per layer (the last one means all done)."""
        return self._run("write", device_pages, host_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> list[CompletionEvent]:
        """Host -> device, layer by layer so a forward pass can start on layer 0 early."""
        if self.fault == "swap-load-pages" and len(device_pages) > 1:
            device_pages = [device_pages[1], device_pages[0], *device_pages[2:]]
        return self._run("load", host_pages, device_pages)

    def close(self) -> None:
        if not self.cuda:
            self._worker.shutdown(wait=True)

    def _run(self, kind: str, src_pages: list[int], dst_pages: list[int]) -> list[CompletionEvent]:
        if not self.cuda:
            events = [HostEvent() for _ in range(self.layers)]
            self._worker.submit(self._copy_layers, kind, list(src_pages), list(dst_pages), events)
            return events
        stream = self._streams[kind]
        # The copy must see every kernel the compute stream queued before it.
        stream.wait_stream(torch.cuda.current_stream())
        cuda_events: list[CompletionEvent] = []
        with torch.cuda.stream(stream):
            pages = self._plan(src_pages, dst_pages)
            for layer in range(self.layers):
                self._copy_layer(kind, layer, pages)
                cuda_events.append(CudaEvent(stream))
        return cuda_events

    def _plan(self, src_pages: list[int], dst_pages: list[int]) -> PagePlan:
        return PagePlan.of(src_pages, dst_pages, self._slabs["device"][0])

    def _copy_layers(self, kind: str, src_pages: list[int], dst_pages: list[int],
                     events: list[HostEvent]) -> None:
        """The worker's side of a CPU op: plans it off the scheduler's thread, then layer by layer."""
        layer = 0
        try:
            pages = self._plan(src_pages, dst_pages)
            for layer, event in enumerate(events):
                if kind == "write" and self.fault == "copy-error":
                    self.fault = None
                    raise RuntimeError(f"injected fault ({faults.ENV}=copy-error)")
                self._copy_layer(kind, layer, pages)
                event.set()
        except Exception as exc:  # noqa: BLE001 - a failed copy must complete its events
            error = CopyFailed(f"layer {layer} copy failed: {type(exc).__name__}: {exc}")
            for later in events[layer:]:
                later.fail(error)

    def _copy_layer(self, kind: str, layer: int, pages: PagePlan) -> None:
        src, dst = ("device", "host") if kind == "write" else ("host", "device")
        pages.move(self._slabs[src][layer], self._slabs[dst][layer])
        if kind == "load" and self.fault == "noise-load":
            kv, landed = self.device.tensor[layer], pages.dst_pages
            kv[landed] *= 1 + 1e-3 * torch.randn_like(kv[landed])


def _rows(pool: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """(layers, pages, ...) -> (layers, pages, words): one row per slab, as `word`s."""
    layers, pages = pool.shape[:2]
    return pool.view(layers, pages, -1).view(word)     # views only: a copy would lose the writes


class _CudaArray:
    """The `__cuda_array_interface__` of a pinned host buffer, as bytes."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host        # keeps the memory alive as long as the device view
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "data": (host.data_ptr(), False), "version": 3}


def _mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The pinned host pool as a tensor on `device`, aliasing the same memory.

    Under unified addressing a kernel reads and writes pinned host memory at its host
    address over the bus, so a gather or scatter kernel moves pages between L1 and L2 with
    no staging copy (what SGLang's I/O kernels do)."""
    if not host.is_pinned():
        raise HiCacheError("the host pool must be pinned for device copies")
    view = torch.as_tensor(_CudaArray(host), device=device)
    if view.data_ptr() != host.data_ptr():      # torch copied it instead of aliasing
        raise HiCacheError(f"could not map the pinned host pool into {device}: set the rank's CUDA "
                           "device before creating the pools")
    return view.view(host.dtype).view(host.shape)
