"""The device copy side's bookkeeping: a load's layers waited for only once their events are
recorded, within a bound, and an op's event failing rather than hanging, but only once what
it queued has passed. And the CUDA side as far as it can be read without a GPU: the driver
API only, and the source order each direction declares."""
from __future__ import annotations

import ast
import ctypes
import inspect
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from hicache_async.errors import UsageError
from hicache_async.transfer import device, dma
from hicache_async.transfer.copier import CopyFailed
from hicache_async.transfer.device import SourceOrder
from hicache_async.transfer.dma import CudaDma
from hicache_async.transfer.dma_plan import Descriptors
from hicache_async.transfer.stream_copies import _Issued, _Landing, _Outcome


class _Recorded:
    """Stands for a recorded torch.cuda.Event: `query` says whether the device passed it."""

    def __init__(self, passed: bool = True, error: str = "") -> None:
        self.passed, self.error = passed, error

    def query(self) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return self.passed


def test_a_layer_is_waited_for_until_its_event_is_recorded():
    landing, first, second = _Landing(), _Recorded(), _Recorded()
    landing.record(first)
    threading.Timer(0.2, landing.record, (second,)).start()
    assert landing.recorded(0, 5) is first
    start = time.perf_counter()
    assert landing.recorded(1, 5) is second
    assert time.perf_counter() - start >= 0.15


def test_a_layer_never_recorded_is_a_one_line_error_naming_it_after_the_bound():
    landing = _Landing()
    landing.record(_Recorded())
    with pytest.raises(CopyFailed, match=r"^load: layer 1's copies were not issued within 0.1 s$"):
        landing.recorded(1, 0.1)


def test_a_failed_load_thread_wakes_the_waiters_with_the_event_after_what_it_queued():
    landing, issued = _Landing(), Future()
    issued.add_done_callback(landing.settle)
    threading.Timer(0.1, issued.set_exception, (RuntimeError("no stream"),)).start()
    assert landing.recorded(0, 5) is None           # the thread raised: nothing was queued
    landing, stopped, end = _Landing(), Future(), _Recorded(passed=False)
    first = _Recorded()
    landing.record(first)
    stopped.add_done_callback(landing.settle)
    stopped.set_result(_Outcome(end, CopyFailed("refused at copy 3")))
    assert landing.recorded(0, 5) is first and landing.recorded(1, 5) is end and landing.recorded(2, 5) is end
    done = Future()
    done.set_result(_Outcome(_Recorded(), None))
    _Landing().settle(done)         # a thread that succeeded fails nothing


def test_an_op_event_is_done_once_issued_and_passed_and_failed_when_anything_raised():
    issued, recorded = Future(), _Recorded(passed=False)
    event = _Issued(issued, "save of 3 blocks")
    assert not event.query()                            # not issued yet
    issued.set_result(_Outcome(recorded, None))
    assert not event.query() and event.error is None    # issued, not passed
    recorded.passed = True
    assert event.query() and event.error is None

    thrown = Future()
    thrown.set_exception(RuntimeError("the thread could not start"))
    failed = _Issued(thrown, "save of 3 blocks")
    assert failed.query() and "save of 3 blocks failed: RuntimeError: the thread could not" in str(failed.error)

    faulted = Future()
    faulted.set_result(_Outcome(_Recorded(error="CUDA error: an illegal memory access was encountered"), None))
    late = _Issued(faulted, "load of 2 blocks")
    assert late.query() and "load of 2 blocks failed: RuntimeError: CUDA error: an illegal" in str(late.error)
    assert late.query()                                 # and stays so


def test_a_batch_that_failed_part_way_fails_its_op_only_once_what_it_queued_has_passed():
    """Changed on purpose (issue 46, B2): a failed batch's event was done at once, while the
    copies queued before the failure could still write the slot the scheduler then reused."""
    queued, stopped = _Recorded(passed=False), Future()
    stopped.set_result(_Outcome(queued, CopyFailed("cuMemcpyBatchAsync of 96 copies failed: CUDA error 1 at copy 40")))
    failed = _Issued(stopped, "save of 3 blocks")
    assert not failed.query() and failed.error is None
    queued.passed = True
    assert failed.query() and "save of 3 blocks failed: CopyFailed: cuMemcpyBatchAsync" in str(failed.error)


def _has_cuda_bindings() -> bool:
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_has_cuda_bindings(), reason="cuda-bindings is installed here")
def test_without_cuda_bindings_the_cuda_side_is_refused_in_one_line_naming_the_package():
    with pytest.raises(UsageError) as refused:
        CudaDma(torch.device("cuda", 0))
    assert "\n" not in str(refused.value) and "cuda-bindings" in str(refused.value)


def _imports(module) -> set[str]:
    """Every module a source file names in an import, `from a import b` as a and a.b."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_the_cuda_side_uses_the_driver_api_and_never_the_runtimes():
    """cuda-bindings 13.x links the CUDA 13 runtime (a 580+ driver); its driver module works on any."""
    for module in (dma, device):
        imported = _imports(module)
        assert not {name for name in imported if name.startswith("cuda.bindings.runtime")}, module.__name__
    assert "cuda.bindings.driver" in _imports(dma)


def test_source_orders_are_cudas_and_each_batch_declares_its_own():
    """CUmemcpySrcAccessOrder in cuda.h: STREAM 1, ANY 3. The CUDA side puts the order it is
    given in the batch's attributes (a stand-in for the driver's entry point reads them)."""
    assert (SourceOrder.STREAM, SourceOrder.ANY) == (1, 3)
    declared = []

    def batch(dst, src, size, count, attrs, attr_index, attr_count, failed, stream):
        declared.append((dma.Attributes.from_address(attrs).srcAccessOrder, attr_count, stream))
        return 0
    cuda = object.__new__(CudaDma)
    cuda._batch, cuda._first = batch, ctypes.c_size_t(0)
    one = Descriptors(*(np.array([n], dtype=np.int64) for n in (1, 2, 3)))
    cuda.copy(one, 77, SourceOrder.ANY)
    cuda.copy(one, 78, SourceOrder.STREAM)
    assert declared == [(3, 1, 77), (1, 1, 78)]
