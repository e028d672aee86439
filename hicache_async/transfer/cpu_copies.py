"""The Copier on the CPU: pages between the pools by the CPU's own copies, one event per layer.

A worker thread takes the ops in FIFO order and sets host-side events. Big slabs move as
strided copies of page runs a group of layers at a time (`run_plan`), the copies of each group
shared with a helper thread (the copies release the GIL); a group's events are set once both
threads are done with it. Small slabs, where a call per run (or a memmove per DMA descriptor)
would cost more than the bytes, go through the index kernels (`index_plan`) a layer at a time.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..errors import CopyFailed
from ..events import HostEvent
from ..pools import DevicePool, HostPool
from .index_plan import IndexPlan, slab_rows
from .run_plan import Copy, RunPlan

_SIDES = {"write": ("device", "host"), "load": ("host", "device")}


class CpuCopies:
    def __init__(self, device: DevicePool, host: HostPool, noisy: bool = False) -> None:
        """`noisy`: loads add noise to the pages they deliver (the `noise-load` fault)."""
        self.device, self.layers, self.noisy = device, device.layout.num_layers, noisy
        # Both pools as (layers, pages, words): page p of layer l is the slab [l, p] on either side;
        # for the index kernels each layer's (pages, words) view, for the run copies numpy's.
        slab = device.layout.layer_page_bytes
        slabs = {"device": slab_rows(device.tensor, slab), "host": slab_rows(host.tensor.transpose(0, 1), slab)}
        self._layer_slabs = {side: rows.unbind(0) for side, rows in slabs.items()}
        self._rows = {side: rows.numpy() for side, rows in slabs.items()}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy-helper")

    def run(self, kind: str, src_pages: list[int], dst_pages: list[int]) -> list[HostEvent]:
        """`kind`: "write" (device -> host) or "load"; the pages checked in range."""
        events = [HostEvent() for _ in range(self.layers)]
        self._worker.submit(self._copy_layers, kind, list(src_pages), list(dst_pages), events)
        return events

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self._helper.shutdown(wait=True)

    def _copy_layers(self, kind: str, src_pages: list[int], dst_pages: list[int],
                     events: list[HostEvent]) -> None:
        """The worker's side of an op: plans it off the scheduler's thread, then sets each
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
        runs = RunPlan.of(src_pages, dst_pages, self.layers, self.device.layout.layer_page_bytes)
        if runs is not None:
            yield from self._run_groups(kind, runs, dst_pages)
            return
        pages = IndexPlan.of(src_pages, dst_pages, self._layer_slabs["device"][0])
        src, dst = _SIDES[kind]
        for layer in range(self.layers):
            pages.move(self._layer_slabs[src][layer], self._layer_slabs[dst][layer])
            self._add_noise(kind, range(layer, layer + 1), pages.dst_pages)
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
                RunPlan.move(src, dst, copies)
                their_part.result()
                self._add_noise(kind, group, dst_pages)
                yield group
        finally:        # the next op must not start under the helper's feet
            for future in theirs:
                future.cancel()
            helper.result()

    def _add_noise(self, kind: str, layers: range, landed: slice | torch.Tensor | list[int]) -> None:
        if kind == "load" and self.noisy:
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
