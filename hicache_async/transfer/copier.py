"""Moves pages between the device pool (L1) and the host pool (L2), one event per layer.

On a device the pages move as an engine's blocks do (`StreamCopies`): by DMA on the copy
engines, never on the SMs the forward pass needs (index kernels moving KV through the mapped
host pool slowed a neighbouring matmul by 15-20 %, DMA by nothing). A page's slab of a layer
is one run in either pool, so the DMA plan (`dma_plan`) is a descriptor a page and layer
(joined where both pools continue), cut where the host pool's registrations meet. A write is
one batch on the save stream, a load a batch and an event a layer on the load stream, each
issued by its direction's thread; each op first puts the compute stream behind the loads
before it (the caller waits only until their copies are issued). The tree's pins keep what the
slot rules of `stream_copies` ask: nothing writes a page that a copy still reads or writes.
The device is the pool's CUDA device, or one given: the simulated device (`sim_device`) the
CPU tests run this same path over. On the CPU the copies are the CPU's own (`cpu_copies`).
Either way the caller gets an event a layer, the last one meaning the op is done, and a
failed copy completes its op's events with CopyFailed, never hanging.
"""
from __future__ import annotations

from .. import faults
from ..errors import CopyFailed
from ..events import CompletionEvent, HostEvent
from ..pools import DevicePool, HostPool
from .cpu_copies import CpuCopies
from .device import CudaDevice, Device
from .dma_plan import DmaPlan, block_runs
from .stream_copies import StreamCopies


class Copier:
    def __init__(self, device: DevicePool, host: HostPool, dma: Device | None = None) -> None:
        """`dma`: the device whose copy engines move the pages (owned from here on), by default
        the device pool's CUDA device, and none (the CPU's copies) for a pool on the CPU."""
        self.device, self.host = device, host
        self.layers = device.layout.num_layers
        self.fault = faults.injected()
        if dma is None and device.tensor.is_cuda:
            dma = CudaDevice(device.tensor.device)
        self._streams = StreamCopies(_dma_plan(device, host), host, dma, self.layers) if dma is not None else None
        self._cpu = CpuCopies(device, host, noisy=self.fault == "noise-load") if dma is None else None

    def write(self, device_pages: list[int], host_pages: list[int]) -> list[CompletionEvent]:
        """Device -> host. Returns one event per layer (the last one means all done)."""
        refused = self._outside(device_pages, host_pages)
        if refused is None and self.fault == "copy-error":
            self.fault = None
            refused = CopyFailed(f"injected fault ({faults.ENV}=copy-error)")
        if refused is not None:
            return self._failed(refused)
        if self._streams is not None:
            return [self._streams.save(host_pages, device_pages)] * self.layers
        return self._cpu.run("write", device_pages, host_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> list[CompletionEvent]:
        """Host -> device, layer by layer so a forward pass can start on layer 0 early."""
        if self.fault == "swap-load-pages" and len(device_pages) > 1:
            device_pages = [device_pages[1], device_pages[0], *device_pages[2:]]
        refused = self._outside(device_pages, host_pages)
        if refused is not None:
            return self._failed(refused)
        if self._streams is not None:
            return self._streams.load_layers(host_pages, device_pages)
        return self._cpu.run("load", host_pages, device_pages)

    def close(self) -> None:
        """Finishes what was handed over and stops the threads (a device's streams too)."""
        if self._streams is not None:
            self._streams.close()
        else:
            self._cpu.close()

    def _outside(self, device_pages: list[int], host_pages: list[int]) -> CopyFailed | None:
        """Why the op may not run, if a page lies outside its pool: a run past the end would
        quietly copy less, a DMA would write memory that is not the pool's."""
        for pool, pages in ((self.device, device_pages), (self.host, host_pages)):
            count = pool.alloc.num_pages
            if pages and not 0 <= min(pages) <= max(pages) < count:
                return CopyFailed(f"{pool.tier} pages {min(pages)}..{max(pages)} outside the pool's {count}")
        return None

    def _failed(self, error: CopyFailed) -> list[CompletionEvent]:
        failed = HostEvent()
        failed.fail(error)
        return [failed] * self.layers


def _dma_plan(device: DevicePool, host: HostPool) -> DmaPlan:
    """Each layer's pages as the plan's blocks of one run: a page's slab of a layer, in the
    order its host page holds that layer."""
    kv = [layer.view(device.num_pages, 1, 1, -1) for layer in device.tensor.unbind(0)]
    return DmaPlan(kv, [block_runs(index, t) for index, t in enumerate(kv)], host)
