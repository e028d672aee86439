"""The worker side's L3 jobs over a real page store, with a backend that lands reads late."""
from __future__ import annotations

import time
from collections import Counter

import torch
from hicache_vllm.plan import Job, Move, StepPlan
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide

from hicache_async.config import CacheConfig
from hicache_async.keys import page_hashes
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.transfer.objects import NO_TENANT
from tests.helpers.slow_backend import SlowWrites, SlowZeroCopy

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


def test_a_prefetch_reads_verified_pages_straight_into_its_slots():
    w, _ = worker(read_s=0.0, timeout_s=5.0)
    hashes = stored(w)
    expected = w.host.tensor[:4].clone()
    assert w._prefetch(Job(1, hashes, NO_TENANT, slots=[7, 6, 5, 4])) == 4
    assert torch.equal(w.host.tensor[[7, 6, 5, 4]], expected)
    assert w.reports() is None                      # nothing held: every read returned in time


def test_a_read_given_up_on_reports_its_slots_held_until_it_returns():
    w, slow = worker(read_s=1.0, timeout_s=0.2)
    hashes = stored(w)
    assert w._prefetch(Job(1, hashes, NO_TENANT, slots=[4, 5, 6, 7])) == 0   # a miss: past its deadline
    assert w.reports().held == Counter({4: 1, 5: 1, 6: 1, 7: 1})
    deadline = time.monotonic() + 10
    while slow.late_reads == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    report = w.reports()
    assert slow.late_reads == 1 and report.released == Counter({4: 1, 5: 1, 6: 1, 7: 1})
    w.close()


def test_a_slot_is_rewritten_only_after_every_backup_reading_it():
    """Two backups read slot 0 (the first one slowly, slot 0 last); a save into slot 0 waits
    for both, so L3 holds each page's own bytes. With one backup remembered a slot, the
    save waits for the second only, and the first stores the new page under the old key."""
    kv = [torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    w = WorkerSide(Settings(storage="none", host_pages=8, storage_timeout=10.0), LAYOUT, RankCoords(), kv)
    w.store = guarded_store(SlowWrites(slow_write_s=0.1), "slow", LAYOUT, RankCoords(),
                            CacheConfig(storage_timeout_s=10.0))
    w.host.tensor[:] = torch.randn(*w.host.tensor.shape).to(torch.bfloat16)
    before = w.host.tensor.clone()
    hashes = page_hashes(range(24), 4)
    w.finish(StepPlan(backups=[Job(0, hashes[:5], NO_TENANT, slots=[4, 5, 6, 7, 0]),
                               Job(1, hashes[5:], NO_TENANT, slots=[0])]))
    kv[0][3], kv[1][3] = torch.ones(2, 4, 16), torch.ones(2, 4, 16)
    w.finish(StepPlan(saves=[Move("r", [0], [3])]))              # a new page into slot 0
    assert torch.equal(w.host.tensor[0, 0], kv[0][3])
    w.close()                                                     # every backup done
    assert w._prefetch(Job(2, hashes[:5], NO_TENANT, slots=[1, 2, 3, 4, 5])) == 5
    assert torch.equal(w.host.tensor[[1, 2, 3, 4, 5]], before[[4, 5, 6, 7, 0]])
    assert w._prefetch(Job(3, hashes[5:], NO_TENANT, slots=[6])) == 1      # the second backup of slot 0
    assert torch.equal(w.host.tensor[6], before[0])


def test_a_slot_whose_reader_outlasts_the_deadline_turns_stale_and_its_loads_are_errors():
    kv = [torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    w = WorkerSide(Settings(storage="none", host_pages=8, storage_timeout=0.05), LAYOUT, RankCoords(), kv)
    w.store = guarded_store(SlowWrites(slow_write_s=1.0), "slow", LAYOUT, RankCoords(),
                            CacheConfig(storage_timeout_s=5.0))
    w.finish(StepPlan(backups=[Job(0, page_hashes(range(4), 4), NO_TENANT, slots=[2])]))
    w.finish(StepPlan(saves=[Move("r", [2, 3], [5, 6])]))
    assert w.readers.stale == {2} and w.reports().stale == {2}
    w.start(StepPlan(loads=[Move("s", [2, 3], [0, 1])]))
    assert w.load_errors() == {0}
    w.finish(StepPlan())
    w.close()


def test_a_load_does_not_wait_for_a_backup_reading_its_slot():
    kv = [torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    w = WorkerSide(Settings(storage="none", host_pages=8, storage_timeout=5.0), LAYOUT, RankCoords(), kv)
    w.store = guarded_store(SlowWrites(slow_write_s=2.0), "slow", LAYOUT, RankCoords(),
                            CacheConfig(storage_timeout_s=5.0))
    w.host.tensor[2] = torch.randn(*w.host.tensor.shape[1:]).to(torch.bfloat16)
    w.finish(StepPlan(backups=[Job(0, page_hashes(range(4), 4), NO_TENANT, slots=[2])]))
    started = time.monotonic()
    w.start(StepPlan(loads=[Move("r", [2], [5])]))
    w.copies.wait_all()
    assert time.monotonic() - started < 1.0 and w.readers.busy() == 1      # the backup still reads slot 2
    assert torch.equal(kv[0][5], w.host.tensor[2, 0]) and torch.equal(kv[1][5], w.host.tensor[2, 1])
    w.close()
