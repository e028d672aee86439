"""The device seam: the few primitives `StreamCopies` drives a device through, and their CUDA side.

Streams, the compute stream, events, graph capture, a thread's device, what "pinned" means for
the host pool, and the DMA executor: on CUDA, torch.cuda and the driver (`dma.CudaDma`); on
CPU, the simulated device (`sim_device`), on which CI runs the very same copy code.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Protocol

import torch

from ..pools import HostPool
from .dma_plan import Descriptors


class SourceOrder(IntEnum):
    """CUmemcpySrcAccessOrder (cuda.h): when a batch may read its sources."""

    STREAM = 1      # in stream order: a save's source, live KV that the compute stream writes
    ANY = 3         # at any time once issued: a load's source, host slots nothing writes while it runs


class Event(Protocol):
    def record(self, stream: Stream) -> None:
        """Passes once `stream` has done everything queued on it before."""

    def query(self) -> bool:
        """Whether it passed, never blocking; raises what the device reports failed."""


class Stream(Protocol):
    def wait_event(self, event: Event) -> None:
        """Later work on this stream waits until `event` passes."""

    def synchronize(self) -> None:
        """Returns once everything queued on it is done."""


class Device(Protocol):
    def stream(self) -> Stream:
        """A new stream of its own."""

    def current_stream(self) -> Stream:
        """The caller's (compute) stream."""

    def event(self) -> Event: ...

    def capturing(self) -> bool:
        """Whether the caller's stream is capturing a graph: nothing may be issued then."""

    def bind(self) -> None:
        """Makes the calling thread issue to this device."""

    def pinned(self, host: HostPool) -> bool:
        """Whether DMA may take the host pool's addresses as they are."""

    def check_host_pointers(self) -> None:
        """Raises UsageError where the device cannot copy a registered host pointer as is."""

    def copy(self, copy: Descriptors, stream: Stream, order: SourceOrder) -> None:
        """Queues the batch on `stream`; raises CopyFailed where the device refused a descriptor
        (those before it may already be queued)."""

    def close(self) -> None:
        """Releases what it holds, once its streams are synchronized."""


class CudaDevice:
    """A CUDA device: torch.cuda's streams and events, the driver's DMA (`dma.CudaDma`)."""

    def __init__(self, device: torch.device) -> None:
        from .dma import CudaDma       # needs cuda-bindings: only where a CUDA side is built

        self.dma = CudaDma(device)
        self.device = torch.device("cuda", self.dma.index)

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def bind(self) -> None:
        self.dma.bind()

    def pinned(self, host: HostPool) -> bool:
        """Page-locked by `HostPool` itself, where CUDA is present."""
        return host.tensor.is_pinned()

    def check_host_pointers(self) -> None:
        self.dma.check_host_pointers()

    def copy(self, copy: Descriptors, stream: torch.cuda.Stream, order: SourceOrder) -> None:
        self.dma.copy(copy, stream.cuda_stream, order)

    def close(self) -> None:
        self.dma.close()
