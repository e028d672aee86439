"""A step's work lies in the slots it changes, not in the host tier's size (issue 41).

The same steps, with eviction, loads, prefetches and backups, over a full host tier of 100
pages and of 100,000 (a tiny layout): the real scheduler and worker sides must read no more
entries of their tables (the slots, the free and evictable queues, the page index, what the
scheduler knows of L3 and its events, the worker's slots and backup gauge) a step over the big
tier than over the small one. Every read is counted: by index or key, or one a walk yields.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

import pytest
import torch
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide

from hicache_async.config import WRITE_POLICIES
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords
from tests.plugins.vllm.stand_ins import Req

PAGE, FILL_PAGES, BLOCKS, STEPS = 4, 1000, 1024, 30
LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=PAGE, dtype=torch.float32,
                  axes=("head", "token", "dim"))
TABLES = (list, dict, OrderedDict, set, Counter)


class Tally:
    def __init__(self) -> None:
        self.visits = 0

    def walk(self, entries):
        for entry in entries:
            self.visits += 1
            yield entry


def counted(table, tally: Tally):
    """A copy of `table` that tallies each entry read from it."""
    base = type(table)
    methods = {"__iter__": lambda self: tally.walk(base.__iter__(self))}
    if hasattr(base, "__getitem__"):
        def getitem(self, key):
            got = base.__getitem__(self, key)
            tally.visits += len(got) if isinstance(key, slice) else 1
            return got
        methods["__getitem__"] = getitem
    if issubclass(base, dict):
        def get(self, key, default=None):
            tally.visits += 1
            return base.get(self, key, default)
        methods.update(get=get, values=lambda self: tally.walk(base.values(self)),
                       items=lambda self: tally.walk(base.items(self)))
    return type(f"Counted{base.__name__}", (base,), methods)(table)


def count_reads(tally: Tally, *owners) -> None:
    for owner in owners:
        for name, value in list(vars(owner).items()):
            if type(value) in TABLES:
                setattr(owner, name, counted(value, tally))


class Engine:
    """vLLM's part, as the connector's hooks see it: requests admitted once their L3 read is
    over, computed in one step, then finished."""

    def __init__(self, policy: str, host_pages: int) -> None:
        self.s = SchedulerSide(Settings(storage="none", host_pages=host_pages, write_policy=policy, l3_reads="always"),
                               PAGE, 1)
        self.s.l3 = True            # L3 jobs planned; the worker has no store, so each ends at once, empty
        kv = [torch.zeros(BLOCKS, 1, PAGE, 2)]
        self.w = WorkerSide(Settings(storage="none", host_pages=host_pages), LAYOUT, RankCoords(), kv)
        self.waiting: list[Req] = []
        self.blocks: dict[str, list[int]] = {}
        self.evicted = 0
        take = self.s.slots.evicted

        def evicted() -> list[str]:
            gone = take()
            self.evicted += len(gone)
            return gone
        self.s.slots.evicted = evicted

    def step(self, *arrivals: Req) -> None:
        self.waiting += arrivals
        scheduled, at = {}, 0
        for req in list(self.waiting):
            hit, _ = self.s.matched(req, 0)
            if hit is None:
                continue            # its L3 read first
            self.s.allocated(req, hit)
            req.num_computed_tokens = hit
            scheduled[req.request_id] = len(req.all_token_ids) - hit
            self.blocks[req.request_id] = list(range(at, at + len(req.all_token_ids) // PAGE + 1))
            at += len(self.blocks[req.request_id])
            self.waiting.remove(req)
        plan = self.s.build(scheduled, self.blocks.__getitem__)
        self.w.start(plan)
        self.w.wait_layer(0)
        self.w.finish(plan)
        self.w.finished_sending(plan)
        reports = self.w.reports()
        for rid in scheduled:
            req = self.s.requests[rid].request
            req.num_computed_tokens = len(req.all_token_ids)
            self.s.finished(req)
        self.s.reported(reports)
        self.w.backup_queue()       # the gauge, read each step as vLLM's stats are
        self.s.events.take()


def visits_per_step(policy: str, host_pages: int) -> tuple[list[int], int]:
    """Fill the tier, then STEPS steps of two new 3-page prompts and one seen two steps ago
    (a host hit): each step's table reads, and the pages evicted meanwhile."""
    engine = Engine(policy, host_pages)
    token = iter(range(1, 1 << 31))
    for _ in range(host_pages // FILL_PAGES or 1):
        pages = min(FILL_PAGES, host_pages)
        engine.step(Req(f"fill{next(token)}", [next(token) for _ in range(pages * PAGE)]))
        engine.step()       # its save's backup reported
    assert not engine.s.slots.free, "the tier is not full"
    tally = Tally()
    count_reads(tally, engine.s, engine.s.slots, engine.s.events, engine.w)
    engine.evicted, prompts, visits = 0, [], []
    for t in range(STEPS):
        prompts.append([[next(token) for _ in range(3 * PAGE + 1)] for _ in range(2)])
        again = [Req(f"again{t}", prompts[t - 2][0])] if t >= 2 else []
        before = tally.visits
        engine.step(*(Req(f"new{t}.{i}", p) for i, p in enumerate(prompts[t])), *again)
        visits.append(tally.visits - before)
    engine.s.slots.check()
    engine.w.close()
    return visits, engine.evicted


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_steps_table_reads_do_not_grow_with_the_host_tier(policy):
    small, evicted_small = visits_per_step(policy, 100)
    big, evicted_big = visits_per_step(policy, 100_000)
    assert evicted_small >= STEPS and evicted_big == evicted_small      # every step evicts, alike
    assert max(big) <= max(small) and sum(big) <= sum(small), (small, big)
