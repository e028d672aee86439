"""The simulated device itself: a stream runs its operations in order and later than issued,
events pass when their stream reaches them, waits are bounded, registrations are what DMA
may span, and each injected fault does what a driver would."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.transfer.copier import CopyFailed
from hicache_async.transfer.device import SourceOrder
from hicache_async.transfer.dma_plan import Descriptors
from hicache_async.transfer.sim_device import SimDevice


def _buffers(n: int = 8, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.arange(n * size, dtype=torch.int32).to(torch.uint8).view(n, size)
    return src, torch.zeros_like(src)


def _rows(src: torch.Tensor, dst: torch.Tensor, rows: list[int]) -> Descriptors:
    at = np.asarray(rows, dtype=np.int64) * src.stride(0)
    return Descriptors(src.data_ptr() + at, dst.data_ptr() + at, np.full(len(rows), src.shape[1], dtype=np.int64))


def _bound(device: SimDevice) -> None:
    device.bind()     # this test's thread issues, as a copy thread would


def test_copies_land_later_than_issued_in_order_and_an_event_passes_when_its_stream_reaches_it():
    device = SimDevice(seed=1, max_delay_s=0.05)
    _bound(device)
    src, dst = _buffers()
    stream, first, second = device.stream(), device.event(), device.event()
    device.copy(_rows(src, dst, [0, 1, 2]), stream, SourceOrder.ANY)
    first.record(stream)
    device.copy(_rows(src, dst, [5]), stream, SourceOrder.STREAM)
    second.record(stream)
    assert not first.query() and not torch.equal(dst[0], src[0])      # not yet: a delay before each op
    stream.synchronize()
    assert first.query() and second.query() and torch.equal(dst[[0, 1, 2, 5]], src[[0, 1, 2, 5]])
    assert not dst[[3, 4, 6, 7]].any() and device.orders == [SourceOrder.ANY, SourceOrder.STREAM]
    device.close()


def test_the_compute_stream_is_the_caller_and_waits_on_a_copy_streams_event_bounded():
    device = SimDevice(seed=2, max_delay_s=0.02)
    _bound(device)
    src, dst = _buffers()
    stream, landed, now = device.stream(), device.event(), device.event()
    assert device.event().query()                   # never recorded: passed, as on CUDA
    now.record(device.current_stream())
    assert now.query()                              # the caller's work is done when issued
    device.copy(_rows(src, dst, [4]), stream, SourceOrder.ANY)
    landed.record(stream)
    device.current_stream().wait_event(landed)      # blocks the caller until the copy landed
    assert landed.query() and torch.equal(dst[4], src[4])
    device.close()


def test_a_stream_waiting_on_an_event_holds_its_later_work_until_it_passes():
    device = SimDevice(seed=3, max_delay_s=0.0)
    _bound(device)
    src, dst = _buffers()
    slow, fast, gate = device.stream(), device.stream(), device.event()
    slow.queue(lambda: time.sleep(0.2))
    gate.record(slow)
    fast.wait_event(gate)
    device.copy(_rows(src, dst, [1]), fast, SourceOrder.ANY)
    time.sleep(0.1)
    assert not dst[1].any()                         # the fast stream waits for the slow one's event
    fast.synchronize()
    assert torch.equal(dst[1], src[1])
    device.close()


def test_a_batch_refused_at_issue_queues_nothing_and_one_failing_after_k_queues_its_first_k():
    device = SimDevice(seed=4)
    _bound(device)
    src, dst = _buffers()
    stream = device.stream()
    device.fail_batch()
    with pytest.raises(CopyFailed, match=r"^simulated batch of 3 copies refused at copy 0$"):
        device.copy(_rows(src, dst, [0, 1, 2]), stream, SourceOrder.ANY)
    device.fail_batch(after=2)
    with pytest.raises(CopyFailed, match="refused at copy 2"):
        device.copy(_rows(src, dst, [3, 4, 5, 6]), stream, SourceOrder.ANY)
    stream.synchronize()
    assert not dst[[0, 1, 2, 5, 6]].any() and torch.equal(dst[[3, 4]], src[[3, 4]])
    device.copy(_rows(src, dst, [7]), stream, SourceOrder.ANY)      # the faults were one batch each
    stream.synchronize()
    assert torch.equal(dst[7], src[7])
    device.close()


def test_a_stalled_event_never_passes_then_fails_its_stream_and_what_waits_on_it():
    device = SimDevice(seed=5, max_delay_s=0.0, bound_s=0.2)
    _bound(device)
    src, dst = _buffers()
    stream, other = device.stream(), device.stream()
    device.stall_event()
    stalled, later, behind = device.event(), device.event(), device.event()
    stalled.record(stream)
    device.copy(_rows(src, dst, [0]), stream, SourceOrder.ANY)
    later.record(stream)
    other.wait_event(stalled)
    behind.record(other)
    assert not stalled.query()
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"^simulated device: an event on sim-stream-0 did not pass within 0.2 s$"):
        device.current_stream().wait_event(stalled)
    assert 0.15 < time.perf_counter() - start < 2
    stream.synchronize()
    other.synchronize()
    for event in (stalled, later, behind):          # sticky: every later event on it, and on the waiter
        with pytest.raises(RuntimeError, match="did not pass within 0.2 s"):
            event.query()
    assert not dst[0].any()                         # a failed stream copies nothing more
    device.close()


def test_registrations_are_what_pinned_means_and_a_descriptor_spanning_two_is_refused():
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=32, page_size=16, dtype=torch.float32)
    host, other = HostPool(layout, 4, chunk_bytes=1), HostPool(layout, 1)
    device = SimDevice(seed=6)
    _bound(device)
    assert not device.pinned(host)
    device.register(host)
    assert device.pinned(host) and not device.pinned(other) and host.chunk_bytes == 4096
    src = torch.zeros(8192, dtype=torch.uint8)
    across = Descriptors(np.array([src.data_ptr()], dtype=np.int64), np.array([host.page_ptr(0) + 4000],
                         dtype=np.int64), np.array([200], dtype=np.int64))
    with pytest.raises(CopyFailed, match="refused at copy 0"):
        device.copy(across, device.stream(), SourceOrder.STREAM)
    device.close()


def test_only_a_bound_thread_may_issue_and_close_stops_every_stream_thread():
    device = SimDevice(seed=7)
    src, dst = _buffers()
    stream = device.stream()
    with pytest.raises(CopyFailed, match=r"^simulated device: a batch issued from MainThread, a thread never bound"):
        device.copy(_rows(src, dst, [0]), stream, SourceOrder.ANY)
    stream.queue(lambda: time.sleep(0.05))
    device.close()
    assert not any(t.name.startswith("sim-stream-") for t in threading.enumerate())
