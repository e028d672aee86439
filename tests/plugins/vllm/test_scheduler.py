"""The scheduler side's decisions, one class under test with a stand-in for vLLM's Request."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from hicache_vllm.plan import JobReports
from hicache_vllm.scheduler import RequestPages, SchedulerSide
from hicache_vllm.settings import Settings
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

PAGE = 4


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: object = None
    prompt_embeds: object = None
    mm_features: list = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def side(workers: int = 1, **settings) -> SchedulerSide:
    return SchedulerSide(Settings(**{"host_pages": 4, **settings}), PAGE, workers)


def blocks(req_id: str) -> list[int]:
    return list(range(100, 120))


def computed(s: SchedulerSide, req: Req, tokens: int):
    """vLLM schedules `tokens` of `req` this step; the plan it gets."""
    plan = s.build({req.request_id: tokens}, blocks)
    req.num_computed_tokens += tokens
    return plan


def test_write_through_saves_each_completed_page_and_backs_it_up():
    s, req = side(), Req("a", list(range(13)))
    assert s.matched(req, 0) == (None, False)          # it looks in L3 first
    s.reported(JobReports({0: (1, 0)}))
    s.build({}, blocks)
    assert s.matched(req, 0) == (0, False)
    plan = computed(s, req, 13)
    (save,) = plan.saves
    assert save.blocks == [100, 101, 102] and len(set(save.slots)) == 3
    (backup,) = plan.backups
    assert backup.slots == save.slots and backup.req_ids == ["a"]


def test_write_back_stores_a_page_only_as_it_leaves_the_host_tier():
    s = side(write_policy="write_back", storage="none")
    s.l3 = True
    for name in "abc":
        req = Req(name, [ord(name)] * 8 + [0])
        s.requests[name] = RequestPages(req, looked_in_l3=True)
        plan = computed(s, req, 9)
        assert not plan.backups
    assert [len(j.hashes) for j in plan.evictions] == [2]          # a's two pages made room for c's
    assert set(plan.evictions[0].slots) == set(plan.saves[0].slots)


def test_a_prefetch_serves_only_what_every_worker_verified_from_the_slots_it_read_into():
    s, req = side(workers=2), Req("a", list(range(17)))
    assert s.matched(req, 0) == (None, False)
    (job,) = s.build({}, blocks).prefetches
    assert len(job.hashes) == 4 and len(set(job.slots)) == 4
    s.reported(JobReports({job.job: (1, 4)}))
    assert s.matched(req, 0) == (None, False)          # one worker of two has answered
    s.reported(JobReports({job.job: (1, 3)}))
    assert s.matched(req, 0) == (12, False)
    s.allocated(req, 12)
    (load,) = computed(s, req, 5).loads
    assert load.slots == job.slots[:3] and load.blocks == [100, 101, 102]
    assert s.index.free.free == 1                       # the fourth slot holds no page: free again
    assert s.finished(req) == {"hicache": {"host_tokens": 0, "l3_tokens": 12, "model": ""}}


def test_a_load_holds_its_slots_until_a_plan_carries_it():
    s = side(host_pages=2, storage="none")
    a = Req("a", list(range(9)))
    s.matched(a, 0)
    computed(s, a, 9)
    b = Req("b", list(range(9)))
    assert s.matched(b, 0) == (8, False)
    s.allocated(b, 8)
    c = Req("c", list(range(50, 59)))
    s.matched(c, 0)
    plan = s.build({"c": 9}, blocks)             # b not scheduled yet: its slots stay b's
    assert not plan.loads and not plan.saves
    plan = s.build({"b": 1}, blocks)
    assert plan.loads[0].slots and plan.loads[0].blocks == [100, 101]


def test_a_plans_saves_may_reuse_the_slots_its_loads_read_first():
    s = side(host_pages=2, storage="none")
    a, b, c = Req("a", list(range(9))), Req("b", list(range(9))), Req("c", list(range(50, 59)))
    s.matched(a, 0)
    computed(s, a, 9)
    s.matched(b, 0)
    s.allocated(b, 8)
    s.matched(c, 0)
    plan = s.build({"b": 1, "c": 9}, blocks)
    assert plan.saves[0].slots == plan.loads[0].slots    # a worker loads before it saves


def test_tenants_and_events():
    s = side(storage="none")
    a = Req("a", list(range(9)), cache_salt="t1", block_hashes=[b"h0", b"h1"])
    b = Req("b", list(range(9)), cache_salt="t2")
    for req in (a, b):
        s.matched(req, 0)
        computed(s, req, 9)
    assert len(s.index.slot_of) == 4                   # the same tokens, two tenants: four pages
    stored = [e for e in s.events.take() if type(e).__name__ == "BlockStored"]
    assert stored[0].medium == "CPU" and stored[0].block_hashes == [maybe_convert_block_hash(b"h0")]


def test_stats_are_each_intervals_sums_added_across_workers():
    from hicache_vllm.stats import Deltas

    deltas = Deltas()
    assert deltas.take({"l3_read_pages": 0}) is None
    first = deltas.take({"l3_read_pages": 3, "l3_corrupt_objects": 1})
    assert first.data == {"l3_read_pages": 3, "l3_corrupt_objects": 1}
    assert deltas.take({"l3_read_pages": 3, "l3_corrupt_objects": 1}) is None      # nothing new
    other = Deltas().take({"l3_read_pages": 2})
    assert first.aggregate(other).reduce() == {"l3_read_pages": 5, "l3_corrupt_objects": 1}


def selective() -> SchedulerSide:
    s = side(write_policy="write_through_selective", storage="none")
    s.l3 = True
    return s


def test_selective_write_through_counts_device_cache_hits_as_uses():
    """Computed once, then reused from vLLM's own cache: the second use backs it up; a third
    use while that backup runs issues no other, and a stored page is not backed up again."""
    s = selective()
    a = Req("a", list(range(9)))
    s.requests["a"] = RequestPages(a, looked_in_l3=True)
    assert not computed(s, a, 9).backups
    assert s.matched(Req("b", list(range(9))), 8) == (0, False)        # 8 tokens from vLLM's device cache
    (backup,) = s.build({}, blocks).backups
    assert backup.hashes == s.requests["a"].hashes
    s.matched(Req("c", list(range(9))), 8)
    assert not s.build({}, blocks).backups                             # its backup is under way
    s.reported(JobReports({backup.job: (1, 2)}))
    s.matched(Req("d", list(range(9))), 8)
    assert not s.build({}, blocks).backups                             # already in L3


def test_a_backup_pins_its_slots_until_every_worker_reported_it():
    """A save never waits for L3: it takes no slot a backup still reads, and skips the tier
    when only such slots are left."""
    s = side(workers=2, host_pages=2, storage="none")
    s.l3 = True
    a, b = Req("a", list(range(9))), Req("b", list(range(50, 59)))
    for req in (a, b):
        s.requests[req.request_id] = RequestPages(req, looked_in_l3=True)
    (backup,) = computed(s, a, 9).backups
    assert not computed(s, b, 9).saves
    s.reported(JobReports({backup.job: (1, 2)}))                       # one worker of two
    b.num_computed_tokens = 0
    s.requests["b"] = RequestPages(b, looked_in_l3=True)
    assert not computed(s, b, 9).saves
    s.reported(JobReports({backup.job: (1, 2)}))
    b.num_computed_tokens = 0
    s.requests["b"] = RequestPages(b, looked_in_l3=True)
    assert sorted(computed(s, b, 9).saves[0].slots) == sorted(backup.slots)


def test_a_prefetch_no_worker_reports_is_given_up_after_storage_timeout():
    s = side(storage_timeout=0.05)
    req = Req("a", list(range(13)))
    assert s.matched(req, 0) == (None, False)
    time.sleep(0.1)
    assert s.matched(req, 0) == (0, False)                             # recomputed, not parked


def test_pages_in_stale_slots_are_forgotten():
    s = side(storage="none")
    a = Req("a", list(range(9)))
    s.matched(a, 0)
    (save,) = computed(s, a, 9).saves
    s.reported(JobReports({}, {save.slots[1]}))
    assert s.matched(Req("b", list(range(9))), 0) == (4, False)         # page 0 only


def test_a_page_that_failed_its_prefetch_is_backed_up_again():
    s = side(host_pages=3)
    a = Req("a", list(range(13)))
    s.matched(a, 0)
    (probe,) = s.build({}, blocks).prefetches
    s.reported(JobReports({probe.job: (1, 0)}))
    s.matched(a, 0)
    (backup,) = computed(s, a, 13).backups
    s.reported(JobReports({backup.job: (1, 3)}))                        # all three in L3
    c = Req("c", list(range(50, 63)))
    s.requests["c"] = RequestPages(c, looked_in_l3=True)
    (c_backup,) = computed(s, c, 13).backups                            # a's pages leave the host tier
    s.reported(JobReports({c_backup.job: (1, 3)}))
    b = Req("b", list(range(13)))
    assert s.matched(b, 0) == (None, False)
    (fetch,) = s.build({}, blocks).prefetches
    s.reported(JobReports({fetch.job: (1, 1)}))                         # page 1 failed verification
    assert s.matched(b, 0) == (4, False)
    s.allocated(b, 4)
    s.build({"b": 1}, blocks)
    b.num_computed_tokens = 4
    (again,) = computed(s, b, 9).backups
    assert again.hashes == s.requests["b"].hashes[1:3]


def test_prompt_logprobs_and_skip_reading_get_no_external_hit():
    s = side(storage="none")
    a = Req("a", list(range(9)))
    s.matched(a, 0)
    computed(s, a, 9)
    scored = Req("b", list(range(9)))
    scored.sampling_params = type("P", (), {"prompt_logprobs": 1})()
    skipping = Req("c", list(range(9)))
    skipping.skip_reading_prefix_cache = True
    assert s.matched(scored, 0) == (0, False) and s.matched(skipping, 0) == (0, False)
    assert s.matched(Req("d", list(range(9))), 0) == (8, False)


def test_a_slot_a_late_read_may_write_is_given_to_no_page_until_every_worker_released_it():
    s, req = side(workers=2, host_pages=4), Req("a", list(range(17)))
    s.matched(req, 0)
    (job,) = s.build({}, blocks).prefetches
    late = job.slots[2]
    s.reported(JobReports({job.job: (1, 2)}, held=Counter({late: 1})))
    s.reported(JobReports({job.job: (1, 4)}, held=Counter({late: 1})))
    assert s.index.free.free == 1 and late in s.spare                  # slot 3 free, slot 2 held
    s.reported(JobReports(released=Counter({late: 1})))
    assert late in s.spare                                              # one worker's read still out
    s.reported(JobReports(released=Counter({late: 1})))
    assert s.index.free.free == 2 and not s.spare
