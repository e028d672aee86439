"""A storage that dies or hangs costs seconds: the deadline, the breaker, and a whole run on one."""
import time

import pytest

from hicache_async.config import CacheConfig
from hicache_async.engine.kv_witness import KVCheck
from hicache_async.engine.tiny.kv_record import RecordedKV
from hicache_async.engine.tiny.model import ModelConfig, TinyModel
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.errors import StorageError
from hicache_async.hicache.plugin import HiCachePlugin
from hicache_async.storage.guarded import GuardedStorage
from hicache_async.storage.memory import MemoryStorage
from tests.helpers.engine_run import run_cached
from tests.helpers.fake_storages import DownStorage, HangingStorage
from tests.helpers.reference_kv import reference

FAST = CacheConfig(storage_timeout_s=0.3, storage_breaker_failures=2, storage_retry_s=0.2)


def test_a_call_that_never_returns_is_an_error_after_the_deadline_and_is_told_so():
    hung = HangingStorage()
    guard = GuardedStorage(hung, FAST)
    start = time.monotonic()
    try:
        with pytest.raises(StorageError, match=r"batch_get still running after 0.3 s"):
            guard.batch_get(["k"], [memoryview(bytearray(4))])
        assert 0.3 <= time.monotonic() - start < 1.0
    finally:
        hung.release.set()
    deadline = time.monotonic() + 5
    while not hung.woke_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hung.woke_abandoned == [True]     # the late call knows its caller gave up


def test_breaker_fails_fast_then_a_background_probe_closes_it():
    down = DownStorage()
    guard = GuardedStorage(down, FAST)
    for _ in range(2):
        with pytest.raises(StorageError, match="connection refused"):
            guard.batch_exists(["k"])
    calls = down.calls
    start = time.monotonic()
    for _ in range(50):
        with pytest.raises(StorageError, match="unavailable .*2 calls failed in a row"):
            guard.batch_exists(["k"])
    assert time.monotonic() - start < 0.1 and down.calls == calls    # open: the backend is spared
    down.down = False
    time.sleep(0.25)
    with pytest.raises(StorageError, match="unavailable"):   # starts the probe, still fails fast
        guard.batch_exists(["k"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert guard.batch_exists(["k"]) == 0
            break
        except StorageError:
            time.sleep(0.02)
    else:
        pytest.fail("the breaker did not close after the backend came back")
    assert guard.opened == 1


def test_a_store_whose_probe_answers_while_its_transfers_hang_costs_ever_fewer_deadlines():
    """The index answers, the data path hangs: each probe closes the breaker, so the next real
    call costs a deadline. Half open (one failure reopens) and a doubling wait keep that to 5
    deadlines in 4 s (opens near 0.6, 1.1, 1.8, 2.9 s); a fixed wait with two failures to reopen
    costs about 10 (a cycle every 0.8 s). Load only stretches the cycles, so fewer."""
    hung = HangingStorage()
    guard = GuardedStorage(hung, FAST)
    end = time.monotonic() + 4
    try:
        while time.monotonic() < end:
            with pytest.raises(StorageError):
                guard.batch_get(["k"], [memoryview(bytearray(4))])
            time.sleep(0.01)
    finally:
        hung.release.set()
    deadlines = -hung.calls_left
    assert 3 <= deadlines <= 6 and guard.opened >= 2, (deadlines, guard.opened)


def _timed_run(storage, spec, model) -> tuple[float, dict]:
    """Seconds the cached run took (the reference is computed first, untimed), and its report."""
    cfg = CacheConfig(device_pages=20, host_pages=24, prefetch_threshold=16, storage_timeout_s=0.5,
                      storage_breaker_failures=2, storage_retry_s=0.5)
    plugin = HiCachePlugin(cfg, storage=storage, storage_name=type(storage).__name__)
    outputs, path = reference(model, spec, cfg.page_size)
    layout = TinyModel(model).kv_layout(cfg.page_size)
    check = KVCheck(RecordedKV(path, layout), layout, exact=False)
    start = time.monotonic()
    assert run_cached(plugin, spec, model, check) == outputs
    elapsed = time.monotonic() - start
    assert check.mismatches == 0, check.first_mismatch
    return elapsed, plugin.report()


def test_a_run_on_a_storage_that_hangs_mid_run_costs_seconds_and_no_tokens():
    """Reads and writes hang for good after a few calls: the run ends within seconds of a
    healthy one (a few deadlines, then the breaker; loose, since two loaded cores stretch both
    runs), in about as many steps (an idle loop awaits completions, it does not spin), with the
    same outputs, carried by L1/L2."""
    spec, model = WorkloadSpec(seed=4, requests=16, turns=4, system_len=48, user_len=(8, 24), max_new=6), \
        ModelConfig()
    healthy_s, healthy = _timed_run(MemoryStorage(), spec, model)
    storage = HangingStorage(calls_left=6)
    try:
        hung_s, hung = _timed_run(storage, spec, model)
    finally:
        storage.release.set()
    assert hung["storage_errors"] > 0 and healthy["storage_errors"] == 0, hung
    assert hung_s < 2 * healthy_s + 8, (hung_s, healthy_s)
    assert hung["steps"] < 2 * healthy["steps"] + 50, (hung["steps"], healthy["steps"])
