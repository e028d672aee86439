"""The worker side's L3 jobs over a real page store, with a backend that lands reads late."""
from __future__ import annotations

import time

import torch
from hicache_vllm.plan import Commit, Job
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide

from hicache_async.config import CacheConfig
from hicache_async.keys import page_hashes
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.transfer.objects import NO_TENANT
from tests.helpers.slow_backend import SlowZeroCopy

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.bfloat16,
                  axes=("head", "token", "dim"))


def worker(read_s: float, timeout_s: float) -> tuple[WorkerSide, SlowZeroCopy]:
    kv = [torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    w = WorkerSide(Settings(storage="none", host_pages=8), LAYOUT, RankCoords(), kv)
    slow = SlowZeroCopy(slow_read_s=read_s)
    w.store = guarded_store(slow, "slow", LAYOUT, RankCoords(), CacheConfig(storage_timeout_s=timeout_s))
    return w, slow


def stored(w: WorkerSide) -> list[str]:
    """Four random pages backed up from host slots 0-3; their hashes."""
    hashes = page_hashes(range(16), 4)
    w.host.tensor[:4] = torch.randn(4, *w.host.tensor.shape[1:]).to(torch.bfloat16)
    assert w._backup(Job(0, hashes, NO_TENANT, slots=[0, 1, 2, 3])) == 4
    return hashes


def test_a_prefetch_lands_verified_pages_that_a_commit_copies_into_their_slots():
    w, _ = worker(read_s=0.0, timeout_s=5.0)
    hashes = stored(w)
    assert w._prefetch(Job(1, hashes, NO_TENANT)) == 4
    w._commit(Commit(1, [0, 1, 2, 3], [7, 6, 5, 4]))
    assert torch.equal(w.host.tensor[[7, 6, 5, 4]], w.host.tensor[:4])
    assert w.landing.alloc.free == 8


def test_a_read_given_up_on_keeps_its_landing_pages_until_it_returns():
    w, slow = worker(read_s=1.0, timeout_s=0.2)
    hashes = stored(w)
    assert w._prefetch(Job(1, hashes, NO_TENANT)) == 0          # a miss: the read ran past its deadline
    assert w.landing.alloc.free == 4                            # its four pages are held...
    w._commit(Commit(1, [], []))
    assert w.landing.alloc.free == 4                            # ...even once the job is committed
    deadline = time.monotonic() + 10
    while slow.late_reads == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    assert slow.late_reads == 1 and w.landing.alloc.free == 8   # it wrote them late, then let go
    w.close()
