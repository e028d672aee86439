"""Right KV when a copy fails or is late (issue 41's review, cases 1, 2, 3 and 7): the scheduler
side and real worker sides over CPU tensors and a page store over memory L3; a failed copy is
an event that completes with an error, as a GPU's save thread reports one."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import torch
from hicache_vllm.plan import Job, Move, StepPlan
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide
from structlog.testing import capture_logs

from hicache_async.config import CacheConfig
from hicache_async.events import HostEvent
from hicache_async.keys import page_hashes
from hicache_async.storage.memory import MemoryStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer.copier import CopyFailed
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.transfer.objects import NO_TENANT
from tests.plugins.vllm.test_scheduler import PAGE, Req, looked
from tests.plugins.vllm.test_worker import LAYOUT, held_saves, kv_blocks, writer

BLOCKS = list(range(8))


def failed() -> HostEvent:
    event = HostEvent()
    event.fail(CopyFailed("save of 2 blocks failed: RuntimeError: CUDA out of memory"))
    return event


def failing(w: WorkerSide, op: str) -> None:
    """The worker's `op` copies still run, but their event completes with an error."""
    copy = getattr(w.copies, op)

    def fails(slots, blocks):
        copy(slots, blocks)
        return failed()
    setattr(w.copies, op, fails)


class Engine:
    """One scheduler side and `workers` worker sides (each its own memory L3), stepped as vLLM
    steps them (the KV blocks keep their random bytes: these tests follow pages, not bytes)."""

    def __init__(self, workers: int = 1, **settings) -> None:
        cfg = Settings(storage="memory", host_pages=8, l3_reads="always", **settings)
        self.sched = SchedulerSide(cfg, PAGE, workers)
        self.kvs = [kv_blocks() for _ in range(workers)]
        self.workers = []
        for kv in self.kvs:
            w = WorkerSide(Settings(storage="none", host_pages=8, **settings), LAYOUT, RankCoords(), kv)
            w.jobs.store = guarded_store(MemoryStorage(), "memory", LAYOUT, RankCoords(),
                                         CacheConfig(storage_timeout_s=5.0))
            self.workers.append(w)

    def step(self, scheduled: dict[str, int], reqs: dict[str, Req]) -> StepPlan:
        plan = self.sched.build(scheduled, lambda rid: BLOCKS)
        for w in self.workers:
            w.start(plan)
            for layer in range(LAYOUT.num_layers):
                w.wait_layer(layer)
            w.finish(plan)
        for rid, n in scheduled.items():
            reqs[rid].num_computed_tokens += n
        self.report()
        return plan

    def report(self) -> None:
        reports = [r for r in (w.reports() for w in self.workers) if r is not None]
        if reports:
            self.sched.reported(functools.reduce(lambda a, b: a.aggregate(b), reports))
        self.sched.slots.check()

    def settle(self) -> None:
        """Every L3 job ends and is reported."""
        deadline = time.monotonic() + 10
        while self.sched.jobs and time.monotonic() < deadline:
            time.sleep(0.01)
            self.report()
        assert not self.sched.jobs

    def close(self) -> None:
        for w in self.workers:
            w.close()


def test_a_failed_save_on_one_rank_is_freed_on_every_rank_never_announced_nor_backed_up():
    """Case 1: the second rank's save event completes with an error. No page of the plan is
    offered as a host hit, none is announced or stored in L3, the failing rank forgets them,
    and the request is still finished sending (vLLM frees its blocks)."""
    e = Engine(workers=2)
    failing(e.workers[1], "save")
    a = Req("a", list(range(9)), block_hashes=[b"h0", b"h1"])
    looked(e.sched, a)
    with capture_logs() as logs:
        plan = e.step({"a": 9}, {"a": a})
    e.settle()
    (save,) = plan.saves
    pages = e.sched.requests["a"].hashes
    assert not any(e.sched.slots.holding(h) for h in pages), "a failed save was taken as held"
    assert sorted(e.sched.slots.free) == list(range(8)), "the failed save's slots were not freed"
    assert not [ev for ev in e.sched.events.take() if type(ev).__name__ == "BlockStored"]
    assert not e.workers[1].jobs.in_l3 and not e.workers[1].acks.counts["l3_stored_pages"], \
        "the failing rank backed up a slot whose save failed"
    assert not e.sched.l3_writes.stored, "a page is taken as in L3 though one rank stored nothing"
    assert not e.workers[1].pages.keys() & set(save.slots)
    assert [line["pages"] for line in logs if "dropped" in line["event"]] == [2]
    assert e.workers[1].acks.counts["failed_saves"] == 2 and e.workers[0].acks.counts["failed_saves"] == 0
    b = Req("b", list(range(9)))
    looked(e.sched, b)
    assert e.sched.matched(b, 0) == (0, False)
    assert e.workers[1].finished_sending(StepPlan(step=9, keep=["a"])) == {"a"}
    e.close()


def test_a_preemption_never_times_out_into_another_requests_blocks():
    """Case 2: vLLM gives a preempted request's blocks to another in the next forward pass. Its
    save still in flight is fenced (`BlockCopies.fence_saves`), never given up on after a
    timeout, which would let the save copy the other request's KV under this one's keys: a fence
    that cannot be set stops the engine."""
    w = writer(kv_blocks(), storage_timeout=0.2)
    events = held_saves(w)

    def unissued(timeout_s: float) -> None:
        raise CopyFailed(f"fence: saves handed over not issued within {timeout_s:g} s")
    w.copies.fence_saves = unissued
    w.finish(StepPlan(step=1, saves=[Move("r", [0], [3], ["p"])]))
    with pytest.raises(CopyFailed):
        w.preempted(StepPlan(step=2, preempted=["r"]))
    events[0].set()
    w.close()


def test_write_back_shutdown_backs_up_no_page_whose_save_has_not_landed():
    """Case 2, at shutdown: a save that never lands within flush_timeout leaves its slot's old
    bytes; under write_back the worker backs up only the pages whose saves landed, and says in
    one line how many did not."""
    w = writer(kv_blocks(), write_policy="write_back", flush_timeout=0.3)
    events = held_saves(w)
    hashes = page_hashes(range(12), 4)
    w.finish(StepPlan(step=1, saves=[Move("r", [0], [3], hashes[:1], NO_TENANT)]))
    events[0].set()
    w.finish(StepPlan(step=2, saves=[Move("r", [1, 2], [4, 5], hashes[1:], NO_TENANT)]))     # never lands
    with capture_logs() as logs:
        w.close()
    assert w.jobs._prefetch(Job(1, hashes[1:2], NO_TENANT, slots=[6])) == 0, "an unlanded save was backed up"
    assert w.jobs._prefetch(Job(2, hashes[:1], NO_TENANT, slots=[7])) == 1
    assert [line["pages"] for line in logs if "not landed" in line["event"]] == [2]


def loading_a_prefix(e: Engine) -> Req:
    """a computes two pages (held, backed up); b, sharing them, is matched and allocated the
    load of both: this step loads them and computes b's two more."""
    a = Req("a", list(range(9)))
    looked(e.sched, a)
    e.step({"a": 9}, {"a": a})
    e.settle()
    b = Req("b", list(range(17)))
    looked(e.sched, b)
    assert e.sched.matched(b, 0) == (8, False)
    e.sched.allocated(b, 8)
    b.num_computed_tokens = 8
    return b


def test_a_refused_load_drops_the_saves_computed_over_it_in_its_step():
    """Case 3: b loads a's two pages and computes two more in one step; one rank refuses the
    load of page 1 (its slot holds another page). b's pages from page 1 on are computed over a
    block vLLM must recompute: dropped on that rank, freed on every rank, never backed up;
    the blocks before it (page 0) are a's and stay held."""
    e = Engine(workers=2)
    b = loading_a_prefix(e)
    slot1 = e.sched.slots.slot_of[e.sched.requests["a"].hashes[1]]
    e.workers[1].pages[slot1] = ("another page", NO_TENANT)
    plan = e.step({"b": 9}, {"b": b})
    e.settle()
    (load,) = plan.loads
    (save,) = plan.saves
    assert e.workers[1].load_errors() == {load.blocks[1]} and not e.workers[0].load_errors()
    b_pages = e.sched.requests["b"].hashes
    assert not any(e.sched.slots.holding(h) for h in b_pages[2:]), "a save over a refused load was held"
    assert not e.sched.l3_writes.stored.keys() & set(b_pages[2:]), "a save over a refused load was backed up"
    assert not e.workers[1].pages.keys() & set(save.slots)
    assert e.sched.slots.holding(b_pages[0]) and save.table == BLOCKS[:4]
    e.close()


def test_a_failed_load_is_a_load_error_and_spoils_the_saves_over_it():
    """Case 3: the load's copy event completes with an error: its blocks are load errors (vLLM
    recomputes them) and b's saves over them are dropped."""
    e = Engine(workers=1)
    b = loading_a_prefix(e)
    failing(e.workers[0], "load")
    plan = e.step({"b": 9}, {"b": b})
    e.settle()
    (load,) = plan.loads
    assert e.workers[0].load_errors() == set(load.blocks)
    b_pages = e.sched.requests["b"].hashes
    assert not any(e.sched.slots.holding(h) for h in b_pages[2:]), "a save over a failed load was held"
    assert not e.workers[0].jobs.in_l3 & set(b_pages[2:]), "a save over a failed load was backed up"
    e.close()


def test_a_backup_stores_no_slot_that_no_longer_names_its_page():
    """Case 3: a backup checks each slot still holds the job's page here; one that does not
    is neither stored nor counted."""
    w = writer(kv_blocks())
    hashes = page_hashes(range(8), 4)
    w.pages.update({0: (hashes[0], NO_TENANT), 1: ("another page", NO_TENANT)})
    assert w.jobs._backup(Job(0, hashes, NO_TENANT, slots=[0, 1])) == 1
    assert w.acks.counts["l3_stored_pages"] == 1 and w.jobs._prefetch(Job(1, hashes, NO_TENANT, slots=[5, 6])) == 1
    w.close()


def test_shutdown_under_write_through_drains_the_last_saves_and_their_backups():
    """Case 7: the last step's saves land during close, and the backups that follow them are
    written before the worker exits, under write_through as under write_back; what cannot be
    is counted in one line."""
    kv = kv_blocks()
    w = writer(kv, write_policy="write_through", flush_timeout=5.0)
    events = held_saves(w)
    hashes = page_hashes(range(8), 4)
    w.finish(StepPlan(step=1, saves=[Move("r", [0, 1], [3, 4], hashes, NO_TENANT)],
                      backups=[Job(7, hashes, NO_TENANT, slots=[0, 1], after_save=True)]))
    threading.Timer(0.3, events[0].set).start()
    w.close()
    assert w.acks.counts["l3_stored_pages"] == 2, "the last saves' backups were lost at shutdown"
    assert w.jobs._prefetch(Job(8, hashes, NO_TENANT, slots=[5, 6])) == 2
    assert torch.equal(w.host.tensor[5, 0], kv[0][3]) and torch.equal(w.host.tensor[6, 1], kv[1][4])

    stuck = writer(kv_blocks(), write_policy="write_through", flush_timeout=0.3)
    held_saves(stuck)
    stuck.finish(StepPlan(step=1, saves=[Move("r", [0, 1], [3, 4], hashes, NO_TENANT)],
                          backups=[Job(7, hashes, NO_TENANT, slots=[0, 1], after_save=True)]))
    started = time.monotonic()
    with capture_logs() as logs:
        stuck.close()
    assert time.monotonic() - started < 2.0
    assert [line["pages"] for line in logs if "not landed" in line["event"]] == [2]
    stuck.close()                                                    # once
