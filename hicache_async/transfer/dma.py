"""Runs a DMA plan's descriptors: on CUDA through the device's copy engines, on CPU by plain
memory moves (which the CPU tests use to check a plan byte for byte).

On CUDA one batch is one `cuMemcpyBatchAsync` call (CUDA 12.8+ drivers), reached through
NVIDIA's cuda-bindings and called through ctypes, which lets go of the GIL for the call: a
batch of thousands of descriptors costs the driver milliseconds, which the step's thread must
not wait for. Where the driver lacks it, each descriptor is one `cuMemcpyAsync`. Only the
driver API (`cuda.bindings.driver`), never the runtime's: cuda-bindings 13.x links the CUDA 13
runtime and needs a 580+ driver, its driver module works on any. cuda-bindings is imported here
only, when a CUDA copy side is built.
"""
from __future__ import annotations

import ctypes

import torch

from ..errors import CopyFailed, UsageError
from .dma_plan import Descriptors

_BATCH_ABI = 12080        # the cuMemcpyBatchAsync of CUDA 12.8: its last argument before the stream is failIdx


def memmove(copy: Descriptors) -> None:
    """Every descriptor copied now, one `memmove` each: the CPU's executor."""
    for dst, src, size in zip(copy.dst.tolist(), copy.src.tolist(), copy.size.tolist()):
        ctypes.memmove(dst, src, size)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attributes(ctypes.Structure):
    """CUmemcpyAttributes: one set for every copy of a batch; the location hints left unset
    (they matter only for managed memory)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Location), ("dstLocHint", _Location),
                ("flags", ctypes.c_uint)]


_BatchCall = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)


class CudaDma:
    """One device's copy engines, driven from any thread that called `bind` first."""

    def __init__(self, device: torch.device) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise UsageError("KV copies on CUDA need NVIDIA's cuda-bindings package (pip install cuda-bindings): "
                             f"{exc}") from None
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._driver = driver
        _check(driver, driver.cuInit(0)[0], "cuInit")
        self._device = _checked(driver, driver.cuDeviceGet(self.index), "cuDeviceGet")
        self._context = _checked(driver, driver.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self._batch = _batch_call(driver)
        self._first = ctypes.c_size_t(0)        # the one attribute set applies from the first copy on

    @property
    def batched(self) -> bool:
        """Whether a batch is one driver call (else a call per descriptor)."""
        return self._batch is not None

    def bind(self) -> None:
        """Makes this thread's current device and driver context the KV's: a thread starts with
        none, and torch's device 0 would make a context of its own on a rank whose KV is elsewhere."""
        torch.cuda.set_device(self.index)
        _check(self._driver, self._driver.cuCtxSetCurrent(self._context)[0], "cuCtxSetCurrent")

    def check_host_pointers(self) -> None:
        """DMA takes the host pool's own addresses: the device must accept a registered host
        pointer as is."""
        d = self._driver
        attribute = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
        if not _checked(d, d.cuDeviceGetAttribute(attribute, self._device), "cuDeviceGetAttribute"):
            raise UsageError(f"CUDA device {self.index} cannot use a registered host pointer as is "
                             "(CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM is 0): the host pool "
                             "cannot be copied by DMA on it")

    def copy(self, copy: Descriptors, stream: int, order: int) -> None:
        """Queues the batch on the stream whose handle is `stream`, its sources read in `order`
        (a CUmemcpySrcAccessOrder); raises CopyFailed naming the descriptor refused."""
        if not len(copy):
            return
        if self._batch is None:
            self._one_by_one(copy, stream)
            return
        attributes, failed = Attributes(srcAccessOrder=order), ctypes.c_size_t(0)
        error = self._batch(copy.dst.ctypes.data, copy.src.ctypes.data, copy.size.ctypes.data, len(copy),
                            ctypes.addressof(attributes), ctypes.addressof(self._first), 1,
                            ctypes.addressof(failed), stream)
        if error:
            at = failed.value if failed.value < len(copy) else 0
            raise CopyFailed(f"cuMemcpyBatchAsync of {len(copy)} copies failed: CUDA error {error} at copy "
                             f"{failed.value} ({copy.size[at]} bytes {copy.src[at]:#x} -> {copy.dst[at]:#x})")

    def close(self) -> None:
        """Releases the primary context retained at start, once."""
        if self._context is not None:
            self._context = None
            self._driver.cuDevicePrimaryCtxRelease(self._device)

    def _one_by_one(self, copy: Descriptors, stream: int) -> None:
        d = self._driver
        handle = d.CUstream(stream)
        for dst, src, size in zip(copy.dst.tolist(), copy.src.tolist(), copy.size.tolist()):
            error, = d.cuMemcpyAsync(dst, src, size, handle)
            if error != d.CUresult.CUDA_SUCCESS:
                raise CopyFailed(f"cuMemcpyAsync of {size} bytes {src:#x} -> {dst:#x} failed: {error}")


def _batch_call(driver) -> _BatchCall | None:
    """The driver's cuMemcpyBatchAsync, or None where it has none (older than CUDA 12.8)."""
    found = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", _BATCH_ABI, 0)
    error, address = found[0], found[1]
    if error != driver.CUresult.CUDA_SUCCESS or not address:
        return None
    return _BatchCall(int(address))


def _checked(driver, result: tuple, call: str):
    """The value of a driver call that returned (CUresult, value)."""
    _check(driver, result[0], call)
    return result[1]


def _check(driver, error, call: str) -> None:
    if error != driver.CUresult.CUDA_SUCCESS:
        raise CopyFailed(f"{call} failed: {error}")
