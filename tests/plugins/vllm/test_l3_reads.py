"""Whether the connector reads a prefix from L3 or computes it (`l3_reads`), decided on what its
own workers timed: the scheduler and worker sides without vLLM, over a real page store whose
backend takes `read_s` a read (an injected latency the test changes mid-run), and a forward
pass played by a sleep of a fixed cost plus a cost a token. Not timed: each assertion is on
which way a decision went, with margins of 10x and more either way."""
from __future__ import annotations

import itertools
import time

import pytest
import torch
from hicache_vllm.groups import GroupedScheduler
from hicache_vllm.l3_reads import PROBE_EVERY
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide

from hicache_async.config import CacheConfig
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from tests.helpers.slow_backend import SlowZeroCopy
from tests.plugins.vllm.stand_ins import Req

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.bfloat16,
                  axes=("head", "token", "dim"))
PAGES = 16                   # a prompt's full pages: 64 tokens, about 64 ms to compute here
PASS_S, TOKEN_S = 0.002, 0.001
SLOW_S = 0.4                 # a slow store's read: several times the prompt's prefill
BLOCKS = list(range(1, PAGES + 2))      # block 0 is vLLM's null block
REQUESTS, SALTS = itertools.count(), itertools.count(100)


class Engine:
    """One engine's scheduler and worker sides over `store`."""

    def __init__(self, store: SlowZeroCopy, **settings) -> None:
        self.s = SchedulerSide(Settings(**{"storage": "memory", "host_pages": 4 * PAGES, **settings}),
                               LAYOUT.page_size, 1, page_bytes=LAYOUT.page_bytes)
        kv = [torch.randn(len(BLOCKS) + 1, 2, 4, 16).to(torch.bfloat16) for _ in range(2)]
        self.w = WorkerSide(Settings(storage="none", host_pages=4 * PAGES), LAYOUT, RankCoords(), kv)
        self.w.jobs.store = guarded_store(store, "slow", LAYOUT, RankCoords(), CacheConfig(storage_timeout_s=10.0))

    def step(self, scheduled: dict[str, int]) -> None:
        plan = self.s.build(scheduled, lambda rid: BLOCKS)
        self.w.begin(plan)
        self.w.start(plan)
        if plan.tokens:
            time.sleep(PASS_S + plan.tokens * TOKEN_S)      # the forward pass
        for layer in range(LAYOUT.num_layers):
            self.w.wait_layer(layer)
        self.w.finish(plan)
        self.s.reported(self.w.reports())

    def serve(self, prompt: list[int]) -> int:
        """Prefill `prompt` (taking what the connector offers), then two decode steps; the
        tokens it took from L3."""
        req = Req(f"r{next(REQUESTS)}", prompt)
        while (hit := self.s.matched(req, 0)[0]) is None:
            self.step({})
        self.s.allocated(req, hit)
        req.num_computed_tokens = hit
        for n in (len(prompt) - hit, 1, 1):
            self.step({req.request_id: n})
            req.num_computed_tokens += n
        return self.s.finished(req)[1]["hicache"]["l3_tokens"]

    def close(self) -> None:
        self.w.close()


def prompts(n: int, salt: int) -> list[list[int]]:
    return [[salt, i] + list(range(PAGES * 4 - 1)) for i in range(n)]


@pytest.fixture
def store() -> SlowZeroCopy:
    return SlowZeroCopy(slow_read_s=0.0)


def written(store: SlowZeroCopy, n: int, salt: int) -> list[list[int]]:
    """`n` prompts in `store`, backed up by an engine that computed them."""
    writer = Engine(store)
    todo = prompts(n, salt)
    for p in todo:
        writer.serve(p)
    writer.close()      # its backups flushed
    return todo


def reader(store: SlowZeroCopy, **settings) -> Engine:
    """A new engine that first computes two prompts of its own: its prefill cost is measured."""
    engine = Engine(store, **settings)
    for p in prompts(2, salt=next(SALTS)):
        engine.serve(p)
    return engine


def test_a_fast_store_is_read_and_a_slow_one_is_not_once_a_read_has_shown_it(store):
    todo = written(store, 8, salt=1)
    fast = reader(store)
    assert [fast.serve(p) for p in todo[:3]] == [PAGES * 4] * 3
    fast.close()
    slow = reader(store)
    store.read_s = SLOW_S
    taken = [slow.serve(p) for p in todo[3:8]]
    assert taken[0] == PAGES * 4            # the prior: read, and timed
    assert taken[1:] == [0] * 4             # then computed, never waiting for the slow store
    assert slow.s.counts["l3_declined_pages"] == 4 * PAGES
    slow.close()


def test_the_estimate_follows_a_store_that_slows_down_then_speeds_up_mid_run(store):
    todo = written(store, 3 + 6 + PROBE_EVERY + 3, salt=2)
    engine = reader(store)
    assert [engine.serve(p) for p in todo[:3]] == [PAGES * 4] * 3
    fast_latency = engine.s.l3_reads.cost.latency_s
    store.read_s = SLOW_S
    slowed = [engine.serve(p) for p in todo[3:9]]
    assert slowed[0] == PAGES * 4 and slowed[-1] == 0       # a read or two taught it; then computed
    assert engine.s.l3_reads.cost.latency_s > 10 * fast_latency
    store.read_s = 0.0
    rest = [engine.serve(p) for p in todo[9:]]
    assert PAGES * 4 in rest[:PROBE_EVERY]                  # a probe reads the store again...
    assert rest[-3:] == [PAGES * 4] * 3                     # ...and it is read from then on
    engine.close()


@pytest.mark.parametrize("forced", ["always", "never"])
def test_the_setting_forces_either_way(store, forced):
    todo = written(store, 3, salt=3)
    engine = reader(store, l3_reads=forced)
    store.read_s = 0.0 if forced == "never" else SLOW_S      # each against what the estimate would say
    assert [engine.serve(p) for p in todo] == [PAGES * 4 if forced == "always" else 0] * 3
    engine.close()


def test_first_tokens_are_timed_by_tier_through_the_grouped_scheduler():
    """As the connector calls it: the grouped scheduler makes each request's pages before its
    group's side sees it, and vLLM frees a request its first token stopped before the step's
    connector output comes (`update_connector_output`)."""
    grouped = GroupedScheduler([SchedulerSide(Settings(storage="none"), LAYOUT.page_size, 1)])
    computed, cached = Req("computed", list(range(64))), Req("cached", list(range(100, 164)))
    for req, device in ((computed, 0), (cached, 48)):
        req.arrival_time, req.num_output_tokens = time.time(), 0
        grouped.matched(req, device)
        req.num_output_tokens = 1
    grouped.finished(cached)
    grouped.first_tokens()
    seen = grouped.observed()
    assert {k: len(v) for k, v in seen.items()} == {"ttft_device_seconds": 1, "ttft_none_seconds": 1}
    assert grouped.observed() == {}
