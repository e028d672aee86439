"""No late writes against a real mooncake_master paused with SIGSTOP past the storage deadline,
then resumed: the zero-copy reads under way complete and write their bytes into the host pages
they were for, which the prefetch names (`late`) and the ledger holds until they return, never
into host pages handed to other KV."""
import os
import signal
import threading
import time

import torch
from hicache_mooncake import MooncakeMaster, MooncakeStorage

from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.hicache.plugin import HiCachePlugin
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.base import call_abandoned
from hicache_async.storage.guarded import GuardedStorage
from hicache_async.transfer.page_store import PageStore
from tests.helpers.engine_run import L3_WORKLOAD, assert_matches_reference

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=16)   # 64 KiB pages
FAST = CacheConfig(storage_timeout_s=0.3, storage_retry_s=0.2)


def _until(done, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.02)


def test_a_64_page_prefetch_given_up_on_while_the_master_is_stopped_is_named_till_it_returns(tmp_path):
    with MooncakeMaster(holder_bytes=64 << 20, log_path=str(tmp_path / "master.log")) as master:
        adapter = MooncakeStorage(master.address, master.metadata_url, buffer_bytes=16 << 20)
        try:
            store = PageStore(GuardedStorage(adapter, FAST), LAYOUT, make_key_scheme("rank-suffix", LAYOUT))
            host, reader = HostPool(LAYOUT, 64), HostPool(LAYOUT, 64)
            host.tensor.normal_(generator=torch.Generator().manual_seed(0))
            hashes = page_hashes(range(64 * 16), 16)
            assert store.backup(hashes, host, list(range(64))).ok == [True] * 64
            assert store.prefetch(hashes, reader, list(range(64))).pages == 64   # staging made, registered
            reader.tensor.zero_()
            os.kill(master.pid, signal.SIGSTOP)
            try:
                got = store.prefetch(hashes, reader, list(range(64)))
                assert (got.pages, got.errors, len(got.late)) == (0, 1, 1)
                time.sleep(0.5)
                assert not got.late[0].returned()               # stopped: it can still write the pages
            finally:
                os.kill(master.pid, signal.SIGCONT)
            _until(lambda: got.late[0].returned(), "the stopped call's return")
            _until(lambda: store.counters.quarantined_bytes == 0, "its staged headers back")
            got = store.prefetch(hashes, reader, list(range(64)))  # the master answers again
            assert got.pages == 64 and torch.equal(reader.tensor, host.tensor)
        finally:
            adapter.close()


class PausingMooncake(MooncakeStorage):
    """The real adapter; its first read of a stored object stops the master (SIGSTOP) and
    resumes it (SIGCONT) `pause_s` later, so that read and whatever else runs meanwhile
    outlive their deadline."""

    def __init__(self, master: MooncakeMaster, pause_s: float, **options) -> None:
        super().__init__(master.address, master.metadata_url, **options)
        self.master_pid, self.pause_s = master.pid, pause_s
        self.paused = threading.Event()
        self.late_bytes = 0       # bytes reads wrote after their caller gave up on them

    def batch_get_parts(self, keys, parts, landed=None):
        if not self.paused.is_set() and self.batch_exists(keys[:1]):
            self.paused.set()
            os.kill(self.master_pid, signal.SIGSTOP)
            threading.Timer(self.pause_s, os.kill, (self.master_pid, signal.SIGCONT)).start()
        got = super().batch_get_parts(keys, parts, landed)
        if call_abandoned():
            self.late_bytes += sum(n for n in got if n > 0)
        return got


def test_a_run_through_a_paused_master_keeps_every_page_right(tmp_path):
    cfg = CacheConfig(device_pages=24, host_pages=40, page_size=8, prefetch_threshold=8,
                      storage_timeout_s=0.3, storage_retry_s=0.2)
    with MooncakeMaster(holder_bytes=64 << 20, log_path=str(tmp_path / "master.log")) as master:
        storage = PausingMooncake(master, pause_s=1.5, buffer_bytes=16 << 20)
        try:
            plugin = HiCachePlugin(cfg, storage=storage, storage_name="mooncake")
            report = assert_matches_reference(plugin, L3_WORKLOAD, ModelConfig())
            assert storage.paused.is_set() and report["storage_errors"] > 0, report
            _until(lambda: storage.late_bytes > 0, "the paused read's late bytes")
            _until(lambda: plugin.l3.store.counters.quarantined_bytes == 0, "every quarantined buffer back")
        finally:
            storage.close()
