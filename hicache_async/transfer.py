"""Moves pages between the device pool (L1) and the host pool (L2), one event per layer.

On CUDA the copies run on dedicated copy streams and complete on `torch.cuda.Event`s;
on CPU a single worker thread does them in FIFO order and sets host-side events. Either
way the caller gets the same per-layer events and goes through the same ack queues.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .events import CompletionEvent, CudaEvent, HostEvent
from .pool import DevicePool, HostPool


class Copier:
    def __init__(self, device: DevicePool, host: HostPool) -> None:
        self.device, self.host = device, host
        self.layers = device.layout.num_layers
        self.cuda = device.tensor.is_cuda
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
        if self.cuda:
            return self._run_cuda(kind, device_pages, host_pages)
        events = [HostEvent() for _ in range(self.layers)]
        dev = torch.tensor(device_pages, dtype=torch.long)
        host = torch.tensor(host_pages, dtype=torch.long)
        self._worker.submit(self._copy_layers, kind, dev, host, events)
        return events

    def _copy_layers(self, kind: str, dev: torch.Tensor, host: torch.Tensor,
                     events: list[HostEvent]) -> None:
        d, h = self.device.tensor, self.host.tensor
        for layer, event in enumerate(events):
            if kind == "write":
                h[host, layer] = d[layer].index_select(0, dev)
            else:
                d[layer].index_copy_(0, dev, h[host, layer])
            event.set()

    def _run_cuda(self, kind: str, device_pages: list[int], host_pages: list[int]) -> list[CompletionEvent]:
        stream = self._streams[kind]
        # The copy must see every kernel the compute stream queued before it.
        stream.wait_stream(torch.cuda.current_stream())
        d, h = self.device.tensor, self.host.tensor
        events: list[CompletionEvent] = []
        with torch.cuda.stream(stream):
            for layer in range(self.layers):
                for dp, hp in zip(device_pages, host_pages):
                    if kind == "write":
                        h[hp, layer].copy_(d[layer, dp], non_blocking=True)
                    else:
                        d[layer, dp].copy_(h[hp, layer], non_blocking=True)
                events.append(CudaEvent(stream))
        return events
