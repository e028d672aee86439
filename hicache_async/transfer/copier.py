"""Moves pages between the device pool (L1) and the host pool (L2), one event per layer.

On CUDA the copies run on dedicated copy streams and complete on `torch.cuda.Event`s;
on CPU a single worker thread does them in FIFO order and sets host-side events. Either
way the caller gets the same per-layer events and goes through the same ack queues.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import HiCacheError
from . import faults
from .events import CompletionEvent, CudaEvent, HostEvent
from .pool import DevicePool, HostPool


class CopyFailed(HiCacheError):
    """A layer copy raised: its op's events complete with this error instead of hanging."""


class Copier:
    def __init__(self, device: DevicePool, host: HostPool) -> None:
        self.device, self.host = device, host
        self.layers = device.layout.num_layers
        self.cuda = device.tensor.is_cuda
        self.fault = faults.injected()
        if self.cuda:
            self._streams = {"write": torch.cuda.Stream(), "load": torch.cuda.Stream()}
        else:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")

    def write(self, device_pages: list[int], host_pages: list[int]) -> list[CompletionEvent]:
        """Device -> host. Returns one event per layer (the last one means all done)."""
        return self._run("write", device_pages, host_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> list[CompletionEvent]:
        """Host -> device, layer by layer so a forward pass can start on layer 0 early."""
        return self._run("load", device_pages, host_pages)

    def close(self) -> None:
        if not self.cuda:
            self._worker.shutdown(wait=True)

    def _run(self, kind: str, device_pages: list[int], host_pages: list[int]) -> list[CompletionEvent]:
        if kind == "load" and self.fault == "swap-load-pages" and len(device_pages) > 1:
            device_pages = [device_pages[1], device_pages[0], *device_pages[2:]]
        page_runs = runs(device_pages, host_pages)
        if not self.cuda:
            events = [HostEvent() for _ in range(self.layers)]
            self._worker.submit(self._copy_layers, kind, page_runs, events)
            return events
        stream = self._streams[kind]
        # The copy must see every kernel the compute stream queued before it.
        stream.wait_stream(torch.cuda.current_stream())
        cuda_events: list[CompletionEvent] = []
        with torch.cuda.stream(stream):
            for layer in range(self.layers):
                self._copy_layer(kind, layer, page_runs, non_blocking=True)
                cuda_events.append(CudaEvent(stream))
        return cuda_events

    def _copy_layers(self, kind: str, page_runs: list[tuple[int, int, int]],
                     events: list[HostEvent]) -> None:
        for layer, event in enumerate(events):
            try:
                if kind == "write" and self.fault == "copy-error":
                    self.fault = None
                    raise RuntimeError(f"injected fault ({faults.ENV}=copy-error)")
                self._copy_layer(kind, layer, page_runs, non_blocking=False)
            except Exception as exc:  # noqa: BLE001 - a failed copy must complete its events
                error = CopyFailed(f"layer {layer} copy failed: {type(exc).__name__}: {exc}")
                for later in events[layer:]:
                    later.fail(error)
                return
            event.set()

    def _copy_layer(self, kind: str, layer: int, page_runs: list[tuple[int, int, int]],
                    non_blocking: bool) -> None:
        d, h = self.device.tensor, self.host.tensor
        for dp, hp, n in page_runs:
            if kind == "write":
                h[hp:hp + n, layer].copy_(d[layer, dp:dp + n], non_blocking=non_blocking)
            else:
                d[layer, dp:dp + n].copy_(h[hp:hp + n, layer], non_blocking=non_blocking)
                if self.fault == "noise-load":
                    d[layer, dp:dp + n] *= 1 + 1e-3 * torch.randn_like(d[layer, dp:dp + n])


def runs(device_pages: list[int], host_pages: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce page pairs into (device start, host start, length) runs that are consecutive
    on both sides, so a copy moves a whole run of pages per layer instead of one page."""
    out: list[tuple[int, int, int]] = []
    for dp, hp in zip(device_pages, host_pages):
        if out and out[-1][0] + out[-1][2] == dp and out[-1][1] + out[-1][2] == hp:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((dp, hp, 1))
    return out
