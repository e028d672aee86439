"""The CUDA copy side's bookkeeping, which needs no device: a load's layers waited for only once
their events are recorded, within a bound, and an op's event failing rather than hanging."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from hicache_async.errors import UsageError
from hicache_async.transfer.copier import CopyFailed
from hicache_async.transfer.dma import CudaDma
from hicache_async.transfer.stream_copies import _Issued, _Landing


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


def test_a_failed_load_thread_wakes_the_waiters_with_nothing_to_wait_on():
    landing, issued = _Landing(), Future()
    issued.add_done_callback(landing.settle)
    threading.Timer(0.1, issued.set_exception, (RuntimeError("no stream"),)).start()
    assert landing.recorded(0, 5) is None
    done = Future()
    done.set_result(_Recorded())
    _Landing().settle(done)         # a thread that succeeded fails nothing


def test_an_op_event_is_done_once_issued_and_passed_and_failed_when_anything_raised():
    issued, recorded = Future(), _Recorded(passed=False)
    event = _Issued(issued, "save of 3 blocks")
    assert not event.query()                            # not issued yet
    issued.set_result(recorded)
    assert not event.query() and event.error is None    # issued, not passed
    recorded.passed = True
    assert event.query() and event.error is None

    thrown = Future()
    thrown.set_exception(CopyFailed("cuMemcpyBatchAsync of 96 copies failed: CUDA error 1 at copy 0"))
    failed = _Issued(thrown, "save of 3 blocks")
    assert failed.query() and "save of 3 blocks failed: CopyFailed: cuMemcpyBatchAsync" in str(failed.error)

    faulted = Future()
    faulted.set_result(_Recorded(error="CUDA error: an illegal memory access was encountered"))
    late = _Issued(faulted, "load of 2 blocks")
    assert late.query() and "load of 2 blocks failed: RuntimeError: CUDA error: an illegal" in str(late.error)
    assert late.query()                                 # and stays so


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
