"""No late writes: a storage call given up on (its deadline passed) may still write its bytes
long after, and they must never land in host pages that were freed and handed to other KV.

Reads of whole pages land in the host pages themselves; a call given up on is named in the
prefetch's result, and the step ledger holds those pages from other KV until it returned
(`hicache/quarantine.py`). Reads of strided objects land in staging the call owns; a buffer
whose call was abandoned is quarantined until the call really returns, then goes back to the
pool. A backup makes no header after its caller gave up. All of it against third-party
backends that write late (`tests/helpers/slow_backend.py`), in process and installed for a
real `simulate`."""
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.errors import StorageError
from hicache_async.hicache.plugin import HiCachePlugin
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.base import buffer_address
from hicache_async.storage.file import FileStorage
from hicache_async.storage.guarded import GuardedStorage
from hicache_async.storage.staging import StagingPool
from hicache_async.transfer import checksums
from hicache_async.transfer import page_store as page_store_module
from hicache_async.transfer.page_store import PageStore
from tests.helpers.engine_run import L3_WORKLOAD, assert_matches_reference
from tests.helpers.installed_backend import installed_backend_env
from tests.helpers.slow_backend import SlowReads, SlowZeroCopy

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)
KEYS = make_key_scheme("rank-suffix", LAYOUT)
STRIDED = make_key_scheme("unified", LAYOUT)      # an object per layer and head: views of a page, not runs
HASHES = page_hashes(range(8 * 4), 4)
FAST = CacheConfig(storage_timeout_s=0.3)


def _host(seed: int = 0) -> HostPool:
    host = HostPool(LAYOUT, 8)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return host


def _until(done, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.01)


def _slow_store(slow: SlowReads, keys) -> tuple[PageStore, HostPool, HostPool]:
    """A store whose reads outlive their deadline, with 8 pages stored; their host pages and a
    pool to read them into."""
    host = _host()
    assert PageStore(slow, LAYOUT, keys).backup(HASHES, host, list(range(8))).ok == [True] * 8
    return PageStore(GuardedStorage(slow, FAST), LAYOUT, keys), host, HostPool(LAYOUT, 8)


def test_a_read_of_whole_pages_given_up_on_is_named_while_it_can_still_write_into_them():
    slow = SlowZeroCopy(slow_read_s=0.5)
    store, host, reader = _slow_store(slow, KEYS)
    got = store.prefetch(HASHES, reader, list(range(8)))
    assert (got.pages, got.errors, len(got.late)) == (0, 1, 1)
    assert not got.late[0].returned() and torch.count_nonzero(reader.tensor) == 0
    _until(lambda: got.late[0].returned(), "the late read's return")
    assert slow.late_reads == 1 and torch.equal(reader.tensor, host.tensor)   # its bytes did land, late
    assert store.counters.quarantined_bytes == 0     # only headers were staged, and are back
    slow.read_s = 0.0
    reader.tensor.zero_()
    got = store.prefetch(HASHES, reader, list(range(8)))
    assert (got.pages, got.late) == (8, []) and torch.equal(reader.tensor, host.tensor)


def test_a_strided_read_given_up_on_lands_in_quarantined_staging_never_in_the_host_pages():
    slow = SlowReads(slow_read_s=0.5)
    store, host, reader = _slow_store(slow, STRIDED)
    got = store.prefetch(HASHES, reader, list(range(8)))
    assert (got.pages, got.errors, got.late, store.counters.storage_errors) == (0, 1, [], 1)
    held = store.counters.quarantined_bytes
    assert held >= 8 * LAYOUT.page_bytes          # the call still runs: its buffer is out of the pool
    _until(lambda: slow.late_reads == 1 and store.counters.quarantined_bytes == 0, "the late read's return")
    assert torch.count_nonzero(reader.tensor) == 0  # its bytes never reached the pages it was for
    slow.read_s = 0.0                                # the quarantined buffer serves the next read
    got = store.prefetch(HASHES, reader, list(range(8)))
    assert got.pages == 8 and torch.equal(reader.tensor, host.tensor)
    assert store.staging.buffer_bytes == held and store.staging.quarantined_bytes == 0


class SlowWrites(SlowReads):
    """Writes start only after the caller's deadline (the contract's default parts path then
    asks for each header and joins the parts, reading the host pages)."""

    def batch_set_parts(self, keys, parts, ready=None):
        time.sleep(0.5)
        return super().batch_set_parts(keys, parts, ready)


def test_a_backup_given_up_on_makes_no_header_from_pages_that_moved_on():
    slow = SlowWrites(slow_read_s=0.0)
    host = _host(seed=1)
    stored = PageStore(GuardedStorage(slow, FAST), LAYOUT, KEYS).backup(HASHES, host, list(range(8)))
    assert stored.errors == 8
    host.tensor.copy_(_host(seed=2).tensor)         # the freed pages now hold other KV
    time.sleep(0.6)                                  # the late write has run
    got = PageStore(slow, LAYOUT, KEYS).prefetch(HASHES, HostPool(LAYOUT, 8), list(range(8)))
    assert got.pages == 0                            # nothing stored under the old keys
    assert not slow.objects


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "pooled"])
def test_abandon_waits_for_a_copy_under_way_and_none_starts_after(workers, monkeypatch):
    monkeypatch.setattr(checksums, "CHECKSUM_WORKERS", workers)
    monkeypatch.setattr(checksums, "GROUP_BYTES", 10)     # one item a group
    monkeypatch.setattr(checksums, "HOT_BYTES", 10)
    started, release, copied = threading.Event(), threading.Event(), []

    def copy(group, got):
        started.set()
        release.wait(5)
        copied.append(group.start)

    behind = checksums.Behind([10] * 3, copy)
    threading.Thread(target=behind.landed, args=(0, [10])).start()   # the adapter's thread
    assert started.wait(5)
    abandoning = [threading.Thread(target=behind.abandon) for _ in range(2)]   # the guard, and an error path
    for thread in abandoning:
        thread.start()
    for thread in abandoning:
        thread.join(0.2)
    assert all(thread.is_alive() for thread in abandoning)     # the copy under way won the race: awaited
    release.set()
    for thread in abandoning:
        thread.join(5)
    assert not any(thread.is_alive() for thread in abandoning)
    behind.landed(1, [10, 10])                       # the abandoned call reports late
    time.sleep(0.05)
    assert copied == [0]

    ahead = checksums.Ahead([10] * 3, lambda group: None)
    ahead.wait(0)
    ahead.abandon()
    with pytest.raises(StorageError, match="abandoned"):
        ahead.wait(2)


def test_staging_is_reused_and_a_quarantined_buffer_comes_back_only_when_its_call_returns():
    from concurrent.futures import Future

    from hicache_async.storage.base import AbandonedCall

    registered, gauge = [], []
    pool = StagingPool(registered.append, gauge.append)
    with pool.lease(100) as first:
        first[:3] = b"abc"
    with pool.lease(50) as again:
        assert again.obj is first.obj                # the free buffer serves a smaller lease
    running = Future()
    with pytest.raises(AbandonedCall):
        with pool.lease(100) as stuck:
            raise AbandonedCall("given up on", running)
    with pool.lease(100) as other:
        assert other.obj is not stuck.obj            # quarantined: not handed out
    assert (pool.quarantined_bytes, gauge) == (len(stuck.obj), [len(stuck.obj)])
    running.set_result(None)                         # the call returns
    assert pool.quarantined_bytes == 0 and gauge == [len(stuck.obj), -len(stuck.obj)]
    assert len(registered) == 2 and pool.buffer_bytes == 2 * len(stuck.obj)


def test_a_run_on_a_backend_whose_reads_outlive_their_deadline_keeps_every_page_right():
    """Every L3 read takes 0.5 s against a 0.3 s deadline: each is given up on and its bytes
    land late, into staging quarantined until its call returns. The run still gives the
    reference's tokens and KV, counts the errors, and every quarantined buffer comes back."""
    cfg = CacheConfig(device_pages=24, host_pages=40, page_size=8, prefetch_threshold=8,
                      storage_timeout_s=0.3, storage_retry_s=0.2)
    slow = SlowReads(slow_read_s=0.5)
    plugin = HiCachePlugin(cfg, storage=slow, storage_name="slow")
    held_when_late = []
    slow.on_late = lambda: held_when_late.append(plugin.l3.store.counters.quarantined_bytes)
    report = assert_matches_reference(plugin, L3_WORKLOAD, ModelConfig())
    assert report["storage_errors"] > 0 and report["tokens_from_l3"] == 0, report
    _until(lambda: slow.late_bytes > 0 and plugin.l3.store.counters.quarantined_bytes == 0,
           "every late read's return")
    assert len(held_when_late) == slow.late_reads and all(held_when_late)   # quarantined meanwhile


def test_a_run_whose_reads_land_late_in_the_host_pages_themselves_keeps_every_page_right():
    """The same run on a backend that reads into the host pages themselves, as a zero-copy
    transfer does, and goes on after its deadline: the late bytes do land in host pages, and
    the ledger holds those pages till then, so no page handed to other KV ever takes them."""
    cfg = CacheConfig(device_pages=24, host_pages=40, page_size=8, prefetch_threshold=8,
                      storage_timeout_s=0.3, storage_retry_s=0.2)
    slow = SlowZeroCopy(slow_read_s=0.5)
    plugin = HiCachePlugin(cfg, storage=slow, storage_name="slow")
    report = assert_matches_reference(plugin, L3_WORKLOAD, ModelConfig())
    assert report["storage_errors"] > 0 and report["tokens_from_l3"] == 0, report
    _until(lambda: slow.late_reads > 0, "a late read")
    host = plugin.l3.host.tensor
    start, stop = host.data_ptr(), host.data_ptr() + host.numel() * host.element_size()
    assert any(start <= buffer_address(part) < stop for part in slow.late_parts)   # into host pages


@pytest.mark.parametrize("backend, tp", [("SlowReads", 1), ("SlowZeroCopy", 2)])
def test_simulate_on_an_installed_slow_backend_matches_the_reference(tmp_path, backend, tp):
    """On real ranks: with two, each rank holds the pages its own late calls may write into,
    and both release them at the same step (the agreement compares their digests)."""
    env = installed_backend_env(tmp_path, "slow", f"tests.helpers.slow_backend:{backend}")
    log, out = tmp_path / "late.log", tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "hicache_async", "simulate", "--storage", "slow", "--slow-log", str(log),
         "--storage-timeout", "0.3", "--requests", "16", "--page-size", "8", "--device-pages", "48",
         "--host-pages", "56", "--prefetch-threshold", "8", "--tp", str(tp), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["kv_mismatches"] == 0 and result["kv_verified_pages"] > 0, result
    assert result["outputs_match_reference"] and result["storage_errors"] > 0, result
    late = [int(line.split()[0]) for line in log.read_text().splitlines()]
    assert max(late) > 0                             # the bytes did come, late


STREAM = KVLayout(num_layers=8, kv_heads=2, head_dim=64, page_size=16)   # 64 KiB pages
STREAM_HASHES = page_hashes(range(160 * 16), 16)                         # 160 pages: 10 MiB


def _streamed_store(tmp_path, adapter_class=FileStorage, config=FAST) -> tuple[PageStore, HostPool]:
    """160 pages backed up to a file store as an object per layer and head (4 KiB views of a
    page, so reads are staged), which streams its reads through a ring."""
    host = HostPool(STREAM, 160)
    host.tensor.normal_(generator=torch.Generator().manual_seed(3))
    keys = make_key_scheme("unified", STREAM)
    assert PageStore(FileStorage(str(tmp_path)), STREAM, keys).backup(STREAM_HASHES, host, list(range(160))).ok \
        == [True] * 160
    return PageStore(GuardedStorage(adapter_class(str(tmp_path)), config), STREAM, keys), host


def test_a_streamed_read_waits_for_each_slot_of_its_ring_before_refilling_it(tmp_path, monkeypatch):
    """The file store lands each object in order, so a prefetch reads through a ring of staging
    far smaller than the read; checking and copying each group beside the reader is made slow
    here, so a reader that refilled a slot before its group was copied would be caught."""
    monkeypatch.setattr(checksums, "RING_GROUP", 1 << 20)      # 16 pages a slot: the ring turns 5 times
    land = page_store_module._land

    def slow_land(*args):
        time.sleep(0.01)
        return land(*args)
    monkeypatch.setattr(page_store_module, "_land", slow_land)
    store, host = _streamed_store(tmp_path, config=CacheConfig(storage_timeout_s=30))     # the ring, not the deadline
    reader = HostPool(STREAM, 160)
    got = store.prefetch(STREAM_HASHES, reader, list(range(160)))
    assert (got.pages, got.corrupt) == (160, 0) and torch.equal(reader.tensor, host.tensor)
    assert store.staging.buffer_bytes <= 4 << 20                # a ring, not the read's 10 MiB


class SlowFile(FileStorage):
    """The real file store, each object's read 1.25 ms slow (a busy drive)."""

    def _read(self, *args):
        time.sleep(0.00125)
        return super()._read(*args)


def test_a_streamed_read_given_up_on_copies_nothing_into_host_pages_after(tmp_path):
    store, host = _streamed_store(tmp_path, SlowFile)           # 3.2 s of reads against a 0.3 s deadline
    reader = HostPool(STREAM, 160)
    got = store.prefetch(STREAM_HASHES, reader, list(range(160)))
    assert (got.pages, got.errors) == (0, 1)
    at_give_up = reader.tensor.clone()                          # what landed while the caller waited
    assert store.counters.quarantined_bytes > 0                 # the reader goes on, into its own ring
    _until(lambda: store.counters.quarantined_bytes == 0, "the abandoned read's return")
    assert torch.equal(reader.tensor, at_give_up)               # nothing copied into the pages since
    got = PageStore(FileStorage(str(tmp_path)), STREAM, store.keys).prefetch(STREAM_HASHES, reader, list(range(160)))
    assert got.pages == 160 and torch.equal(reader.tensor, host.tensor)
