"""Moves pages between the device pool (L1) and the host pool (L2), one event per layer.

On CUDA each layer of an op is one gather or scatter kernel (`index_plan`) on a dedicated
copy stream, reading and writing the pinned host pool in place (unified addressing), and
completes on a `torch.cuda.Event`. On CPU a worker thread takes the ops in FIFO order and
sets host-side events. Big slabs move as strided copies of page runs a group of layers at
a time (`run_plan`), the copies of each group shared with a helper thread (the copies
release the GIL). A group's events are set once both threads are done with it. Small
slabs, where a call per run would cost more than the bytes, go through the index kernels
a layer at a time. Either way the caller gets the same per-layer events and goes through
the same ack queues.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .. import faults
from ..errors import HiCacheError
from ..events import CompletionEvent, CudaEvent, HostEvent
from ..pools import DevicePool, HostPool
from .index_plan import IndexPlan, slab_rows
from .run_plan import Copy, RunPlan


class CopyFailed(HiCacheError):
    """A layer copy raised: its op's events complete with this error instead of hanging."""


class Copier:
    def __init__(self, device: DevicePool, host: HostPool) -> None:
        self.device, self.host = device, host
        self.layers = device.layout.num_layers
        self.cuda = device.tensor.is_cuda
        self.fault = faults.injected()
        host_tensor = mapped(host.tensor, device.tensor.device) if self.cuda else host.tensor
        # Both pools as (layers, pages, words): page p of layer l is the slab [l, p] on either side;
        # and, for the index kernels, each layer's (pages, words) view.
        slab = device.layout.layer_page_bytes
        self._slabs = {"device": slab_rows(device.tensor, slab), "host": slab_rows(host_tensor.transpose(0, 1), slab)}
        self._layer_slabs = {side: slabs.unbind(0) for side, slabs in self._slabs.items()}
        if self.cuda:
            self._streams = {"write": torch.cuda.Stream(), "load": torch.cuda.Stream()}
        else:
            self._rows = {side: slabs.numpy() for side, slabs in self._slabs.items()}     # run copies
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy-helper")

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
            self._helper.shutdown(wait=True)

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
            pages = self._index_plan(src_pages, dst_pages)
            for layer in range(self.layers):
                self._copy_layer(kind, layer, pages)
                cuda_events.append(CudaEvent(stream))
        return cuda_events

    def _index_plan(self, src_pages: list[int], dst_pages: list[int]) -> IndexPlan:
        return IndexPlan.of(src_pages, dst_pages, self._layer_slabs["device"][0])

    def _copy_layers(self, kind: str, src_pages: list[int], dst_pages: list[int],
                     events: list[HostEvent]) -> None:
        """The worker's side of a CPU op: plans it off the scheduler's thread, then sets each
        group's events as soon as its layers have landed."""
        done = 0
        try:
            for landed in self._groups(kind, src_pages, dst_pages):
                for layer in landed:
                    events[layer].set()
                done = landed.stop
        except Exception as exc:  # noqa: BLE001 - a failed copy must complete its events
            error = CopyFailed(f"layer {done} copy failed: {type(exc).__name__}: {exc}")
            for later in events[done:]:
                later.fail(error)

    def _groups(self, kind: str, src_pages: list[int], dst_pages: list[int]) -> Iterator[range]:
        """Copies the op, yielding each range of layers once its bytes have landed."""
        for side, pages in zip(_SIDES[kind], (src_pages, dst_pages)):
            count = self._slabs[side].shape[1]      # a run's slice past the end would quietly shrink
            if pages and not 0 <= min(pages) <= max(pages) < count:
                raise IndexError(f"{side} pages {min(pages)}..{max(pages)} outside the pool's {count}")
        runs = RunPlan.of(src_pages, dst_pages, self.layers, self.device.layout.layer_page_bytes)
        if runs is not None:
            yield from self._run_groups(kind, runs, dst_pages)
            return
        pages = self._index_plan(src_pages, dst_pages)
        for layer in range(self.layers):
            self._check_copy_error(kind)
            self._copy_layer(kind, layer, pages)
            yield range(layer, layer + 1)

    def _run_groups(self, kind: str, runs: RunPlan, dst_pages: list[int]) -> Iterator[range]:
        """The run copies of each group, taken by this thread and the helper from one deque, so
        whichever is free takes the next; a group has landed when both are done with it."""
        src, dst = (self._rows[side] for side in _SIDES[kind])
        groups = [range(first, min(first + runs.group, self.layers)) for first in range(0, self.layers, runs.group)]
        shared = [deque(runs.copies(group)) for group in groups]
        theirs = [Future() for _ in groups]
        helper = self._helper.submit(_move_share, src, dst, shared, theirs)
        try:
            for group, copies, their_part in zip(groups, shared, theirs):
                self._check_copy_error(kind)
                RunPlan.move(src, dst, copies)
                their_part.result()
                self._add_noise(kind, group, dst_pages)
                yield group
        finally:        # the next op must not start under the helper's feet
            for future in theirs:
                future.cancel()
            helper.result()

    def _check_copy_error(self, kind: str) -> None:
        if kind == "write" and self.fault == "copy-error":
            self.fault = None
            raise RuntimeError(f"injected fault ({faults.ENV}=copy-error)")

    def _copy_layer(self, kind: str, layer: int, pages: IndexPlan) -> None:
        src, dst = _SIDES[kind]
        pages.move(self._layer_slabs[src][layer], self._layer_slabs[dst][layer])
        self._add_noise(kind, range(layer, layer + 1), pages.dst_pages)

    def _add_noise(self, kind: str, layers: range, landed: slice | torch.Tensor | list[int]) -> None:
        if kind == "load" and self.fault == "noise-load":
            kv = self.device.tensor[layers.start:layers.stop]
            kv[:, landed] *= 1 + 1e-3 * torch.randn_like(kv[:, landed])


def _move_share(src: np.ndarray, dst: np.ndarray, shared: list[deque[Copy]], landed: list[Future]) -> None:
    """The helper's side: takes copies of each group in order, completing the group's future
    once the copies it took have landed; stops at a failure or at a group its op gave up on."""
    for copies, future in zip(shared, landed):
        if not future.set_running_or_notify_cancel():
            return
        try:
            RunPlan.move(src, dst, copies)
        except Exception as exc:  # noqa: BLE001 - the worker raises it for the op
            future.set_exception(exc)
            return
        future.set_result(None)


_SIDES = {"write": ("device", "host"), "load": ("host", "device")}


class _CudaArray:
    """The `__cuda_array_interface__` of a pinned host buffer, as bytes."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host        # keeps the memory alive as long as the device view
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "data": (host.data_ptr(), False), "version": 3}


def mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
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
