"""The scheduler side's decisions, one class under test with a stand-in for vLLM's Request.

The workers are played by the test: a plan's copies and an L3 job change a slot's state only
once every worker reported them (`landed`, `JobReports`)."""
from __future__ import annotations

from collections import Counter

import pytest
from hicache_vllm.host_slots import State
from hicache_vllm.plan import JobReports, StepPlan
from hicache_vllm.scheduler import RequestPages, SchedulerSide
from hicache_vllm.settings import Settings
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from hicache_async.config import WRITE_POLICIES

from tests.plugins.vllm.stand_ins import Req

PAGE = 4


def side(workers: int = 1, **settings) -> SchedulerSide:
    return SchedulerSide(Settings(**{"host_pages": 4, "l3_reads": "always", **settings}), PAGE, workers)


def with_l3(workers: int = 1, **settings) -> SchedulerSide:
    """A side that plans L3 jobs with no store behind it: the test reports them."""
    s = side(workers, storage="none", **settings)
    s.l3 = True
    return s


def blocks(req_id: str) -> list[int]:
    return list(range(100, 120))


def computed(s: SchedulerSide, req: Req, tokens: int) -> StepPlan:
    """vLLM schedules `tokens` of `req` this step; the plan it gets."""
    plan = s.build({req.request_id: tokens}, blocks)
    req.num_computed_tokens += tokens
    s.slots.check()
    return plan


def landed(s: SchedulerSide, plan: StepPlan, workers: int = 1) -> None:
    """`workers` workers report the plan's copies landed."""
    s.reported(JobReports(copied=Counter({plan.step: workers})))
    s.slots.check()


def looked(s: SchedulerSide, *reqs: Req) -> None:
    """Requests that looked in L3 already (none of the test's business)."""
    for req in reqs:
        s.requests[req.request_id] = RequestPages(req, looked_in_l3=True)


def test_write_through_saves_each_completed_page_and_backs_it_up_once_saved():
    s, req = side(), Req("a", list(range(13)))
    assert s.matched(req, 0) == (None, False)          # it looks in L3 first
    s.reported(JobReports({0: (1, 0)}))
    s.build({}, blocks)
    assert s.matched(req, 0) == (0, False)
    plan = computed(s, req, 13)
    (save,) = plan.saves
    assert save.blocks == [100, 101, 102] and len(set(save.slots)) == 3
    assert save.pages == s.requests["a"].hashes
    (backup,) = plan.backups
    assert backup.slots == save.slots and backup.req_ids == ["a"] and backup.after_save


def test_a_saved_page_is_loadable_only_once_every_worker_reported_its_copy():
    s, a = side(workers=2, storage="none"), Req("a", list(range(9)))
    s.matched(a, 0)
    plan = computed(s, a, 9)
    assert s.matched(Req("b", list(range(9))), 0) == (0, False)       # FILLING: not loadable
    landed(s, plan)
    assert s.matched(Req("c", list(range(9))), 0) == (0, False)       # one worker of two
    landed(s, plan)
    assert s.matched(Req("d", list(range(9))), 0) == (8, False)


def test_write_back_stores_a_page_only_as_it_leaves_the_host_tier_and_reuses_its_slot_after_that():
    s = with_l3(write_policy="write_back")
    a, b, c, d = (Req(n, [ord(n)] * 8 + [0]) for n in "abcd")
    looked(s, a, b, c, d)
    for req in (a, b):
        plan = computed(s, req, 9)
        assert not plan.backups
        landed(s, plan)
    plan = computed(s, c, 9)                   # no slot is FREE: a's two pages leave through L3
    assert not plan.saves                      # ...and c's pages skip the tier: a save never waits
    (backup,) = plan.backups
    assert backup.hashes == s.requests["a"].hashes and not backup.after_save
    assert all(s.slots.slots[slot].state is State.LEAVING for slot in backup.slots)
    assert computed(s, d, 0).saves == [] and not s.slots.free       # still leaving, not handed out
    s.reported(JobReports({backup.job: (1, 2)}))
    assert sorted(s.slots.free) == sorted(backup.slots)
    plan = computed(s, d, 9)
    assert sorted(plan.saves[0].slots) == sorted(backup.slots) and not plan.backups


def test_a_page_l3_holds_leaves_under_write_back_without_a_backup():
    s = with_l3(write_policy="write_back", host_pages=2)
    a, b = Req("a", list(range(9))), Req("b", list(range(50, 59)))
    looked(s, a, b)
    landed(s, computed(s, a, 9))
    s.l3_writes.stored.update(dict.fromkeys(s.requests["a"].hashes))         # a prefetch or a backup put them there
    plan = computed(s, b, 9)
    assert not plan.backups and len(plan.saves[0].slots) == 2


def writes_each_slot_once(plan: StepPlan) -> None:
    """No slot is written twice by the plan's saves, and a backup reads a slot the plan saves
    into only as the backup of that very save (`after_save`: it starts once the save landed)."""
    slots = [slot for move in plan.saves for slot in move.slots]
    assert len(slots) == len(set(slots))
    saved = dict(zip(slots, (page for move in plan.saves for page in move.pages)))
    for job in plan.backups:
        if job.after_save:
            assert [saved[slot] for slot in job.slots] == job.hashes
        else:
            assert not saved.keys() & set(job.slots)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_requests_saving_past_the_host_tier_in_one_step_never_share_a_slot(policy):
    """The crowded step: 17-token requests, more than a 4-slot tier holds, saved in one step,
    then again once the first ones' pages are in the tier."""
    s = with_l3(write_policy=policy)
    a, b, c = Req("a", list(range(17))), Req("b", list(range(50, 67))), Req("c", list(range(17)))
    d, e = Req("d", list(range(100, 117))), Req("e", list(range(200, 217)))
    looked(s, a, b, c, d, e)
    plan = s.build({"a": 17, "b": 17, "c": 17}, blocks)
    writes_each_slot_once(plan)
    assert [m.req_id for m in plan.saves] == ["a"] and len(plan.saves[0].slots) == 4     # b and c: no slot
    landed(s, plan)
    for job in plan.backups:
        s.reported(JobReports({job.job: (1, len(job.hashes))}))
    plan = s.build({"d": 17, "e": 17}, blocks)
    s.slots.check()
    writes_each_slot_once(plan)
    leaving = [job for job in plan.backups if not job.after_save]
    if policy == "write_back":      # a's pages leave through L3; their slots serve a later step
        assert not plan.saves and [job.hashes for job in leaving] == [s.requests["a"].hashes]
    else:                           # a's pages are in L3 (or never backed up): their slots are reused
        assert [len(m.slots) for m in plan.saves] == [4] and not leaving


def test_a_prefetch_serves_only_what_every_worker_verified_from_the_slots_it_read_into():
    s, req = side(workers=2), Req("a", list(range(17)))
    assert s.matched(req, 0) == (None, False)
    (job,) = s.build({}, blocks).prefetches
    assert len(job.hashes) == 4 and len(set(job.slots)) == 4
    s.reported(JobReports({job.job: (1, 4)}))
    assert s.matched(req, 0) == (None, False)          # one worker of two has answered
    s.reported(JobReports({job.job: (1, 3)}))
    assert list(s.slots.free) == job.slots[3:]         # the fourth slot holds no page: free again
    assert s.matched(req, 0) == (12, False)
    s.allocated(req, 12)
    req.num_computed_tokens = 12
    plan = computed(s, req, 5)
    (load,) = plan.loads
    assert load.slots == job.slots[:3] and load.blocks == [100, 101, 102] and load.pages == job.hashes[:3]
    assert plan.saves[0].slots == job.slots[3:]        # the page past the verified run is saved
    keep, params = s.finished(req)
    assert keep and params == {"hicache": {"host_tokens": 0, "l3_tokens": 12, "model": "", "fenced_preemptions": 0}}


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_loadable_run_keeps_its_slots_against_its_own_prefetch_in_a_full_tier(policy):
    """The tier is full of evictable pages, the request's first two among them, and the rest
    of its prompt is in L3: the prefetch may take any slot but the run's. (Under write_back
    every page it evicts must reach L3 first, so it gets none: the lookup used to fail on the
    pages it had just counted, and the request lost every tier.)"""
    s = with_l3(write_policy=policy)
    a, b = Req("a", list(range(9))), Req("b", list(range(50, 59)))
    looked(s, a, b)
    for req in (a, b):
        plan = computed(s, req, 9)
        landed(s, plan)
        for backup in plan.backups:         # write_through: stored, so no reader holds the slots
            s.reported(JobReports({backup.job: (1, len(backup.hashes))}))
    x = Req("x", list(range(8)) + list(range(200, 208)) + [0])
    if policy == "write_back":
        assert s.matched(x, 0) == (8, False)
        (backup,) = s.build({}, blocks).backups
        assert backup.hashes == s.requests["b"].hashes          # b's pages leave through L3, not a's
        return
    assert s.matched(x, 0) == (None, False)
    (job,) = s.build({}, blocks).prefetches
    assert job.hashes == s.requests["x"].hashes[2:]
    s.reported(JobReports({job.job: (1, 2)}))
    s.slots.check()
    assert s.matched(x, 0) == (16, False)                       # the run and what L3 gave


def test_a_load_holds_its_slots_until_a_plan_carries_it():
    s = side(host_pages=2, storage="none")
    a = Req("a", list(range(9)))
    s.matched(a, 0)
    landed(s, computed(s, a, 9))
    b = Req("b", list(range(9)))
    assert s.matched(b, 0) == (8, False)
    s.allocated(b, 8)
    c = Req("c", list(range(50, 59)))
    s.matched(c, 0)
    plan = s.build({"c": 9}, blocks)             # b not scheduled yet: its slots stay b's
    assert not plan.loads and not plan.saves
    plan = s.build({"b": 1}, blocks)
    assert plan.loads[0].slots and plan.loads[0].blocks == [100, 101]


def test_a_loads_slots_are_reused_only_once_every_worker_reported_its_plan_copied():
    s = side(workers=2, host_pages=2, storage="none")
    a, b, c, d = Req("a", list(range(9))), Req("b", list(range(9))), Req("c", list(range(50, 59))), \
        Req("d", list(range(60, 69)))
    s.matched(a, 0)
    landed(s, computed(s, a, 9), workers=2)
    s.matched(b, 0)
    s.allocated(b, 8)
    looked(s, c, d)
    plan = s.build({"b": 1, "c": 9}, blocks)
    (load,) = plan.loads
    assert not plan.saves                                    # c's pages skip the tier: b's load reads both slots

    def d_saves():
        d.num_computed_tokens = 0
        looked(s, d)
        return computed(s, d, 9).saves

    landed(s, plan)
    assert not d_saves()                                     # one worker of two: still read
    landed(s, plan)
    assert sorted(d_saves()[0].slots) == sorted(load.slots)


def test_tenants_and_events():
    s = side(storage="none")
    a = Req("a", list(range(9)), cache_salt="t1", block_hashes=[b"h0", b"h1"])
    b = Req("b", list(range(9)), cache_salt="t2")
    for req in (a, b):
        s.matched(req, 0)
        plan = computed(s, req, 9)
        assert not [e for e in s.events.take() if type(e).__name__ == "BlockStored"]    # not landed yet
        landed(s, plan)
        stored = [e for e in s.events.take() if type(e).__name__ == "BlockStored"]
        if req is a:        # one event a page vLLM named, chained
            h0, h1 = maybe_convert_block_hash(b"h0"), maybe_convert_block_hash(b"h1")
            assert [(e.block_hashes, e.parent_block_hash, e.medium) for e in stored] == \
                [([h0], None, "CPU"), ([h1], h0, "CPU")]
        else:               # no block hashes of vLLM's: nothing to name
            assert not stored
    assert len(s.slots.slot_of) == 4                   # the same tokens, two tenants: four pages


def test_stats_are_each_intervals_sums_added_across_workers():
    from hicache_vllm.stats import Deltas, Observed

    deltas = Deltas(Observed("w0"))     # not the process's: a worker opened by another test reports its queue
    assert deltas.take({"l3_read_pages": 0}) is None
    first = deltas.take({"l3_read_pages": 3, "l3_corrupt_objects": 1})
    assert first.data == {"l3_read_pages": 3, "l3_corrupt_objects": 1}
    assert deltas.take({"l3_read_pages": 3, "l3_corrupt_objects": 1}) is None      # nothing new
    other = Deltas(Observed("w1")).take({"l3_read_pages": 2})
    assert first.aggregate(other).reduce() == {"l3_read_pages": 5, "l3_corrupt_objects": 1}


def test_selective_write_through_counts_device_cache_hits_as_uses():
    """Computed once, then reused from vLLM's own cache: the second use backs it up from its
    host slot once its save landed; a third use while that backup runs issues no other, and a
    stored page is not backed up again."""
    s = with_l3(write_policy="write_through_selective")
    a = Req("a", list(range(9)))
    looked(s, a)
    plan = computed(s, a, 9)
    assert not plan.backups
    landed(s, plan)
    assert s.matched(Req("b", list(range(9))), 8) == (0, False)        # 8 tokens from vLLM's device cache
    (backup,) = s.build({}, blocks).backups
    assert backup.hashes == s.requests["a"].hashes and not backup.after_save
    s.matched(Req("c", list(range(9))), 8)
    assert not s.build({}, blocks).backups                             # its backup is under way
    s.reported(JobReports({backup.job: (1, 2)}))
    s.matched(Req("d", list(range(9))), 8)
    assert not s.build({}, blocks).backups                             # already in L3


def test_a_backup_pins_its_slots_until_every_worker_reported_it():
    """A save never waits for L3: it takes no slot a backup still reads, and skips the tier
    when only such slots are left."""
    s = with_l3(workers=2, host_pages=2)
    a, b = Req("a", list(range(9))), Req("b", list(range(50, 59)))
    looked(s, a, b)
    plan = computed(s, a, 9)
    (backup,) = plan.backups
    landed(s, plan, workers=2)

    def b_saves():
        b.num_computed_tokens = 0
        looked(s, b)
        return computed(s, b, 9).saves

    assert not b_saves()
    s.reported(JobReports({backup.job: (1, 2)}))                       # one worker of two
    assert not b_saves()
    s.reported(JobReports({backup.job: (1, 2)}))
    assert sorted(b_saves()[0].slots) == sorted(backup.slots)


def test_a_prefetch_no_worker_reports_is_given_up_after_storage_timeout():
    s, now = side(storage_timeout=5.0), [0.0]
    s.clock = lambda: now[0]
    req = Req("a", list(range(13)))
    assert s.matched(req, 0) == (None, False)
    now[0] = 4.0
    assert s.matched(req, 0) == (None, False)                          # still waited for
    now[0] = 6.0
    assert s.matched(req, 0) == (0, False)                             # recomputed, not parked


def test_a_page_that_failed_its_prefetch_is_backed_up_again():
    s = side(host_pages=3)
    a = Req("a", list(range(13)))
    s.matched(a, 0)
    (probe,) = s.build({}, blocks).prefetches
    s.reported(JobReports({probe.job: (1, 0)}))
    s.matched(a, 0)
    plan = computed(s, a, 13)
    (backup,) = plan.backups
    landed(s, plan)
    s.reported(JobReports({backup.job: (1, 3)}))                        # all three in L3
    c = Req("c", list(range(50, 63)))
    looked(s, c)
    plan = computed(s, c, 13)                                           # a's pages leave the host tier
    (c_backup,) = plan.backups
    landed(s, plan)
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
    landed(s, computed(s, a, 9))
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
    late, spare = job.slots[2], job.slots[3]
    s.reported(JobReports({job.job: (1, 2)}, held=Counter({late: 1})))
    s.reported(JobReports({job.job: (1, 4)}, held=Counter({late: 1})))
    assert list(s.slots.free) == [spare] and s.slots.slots[late].state is State.LEAVING
    s.reported(JobReports(released=Counter({late: 1})))
    assert late not in s.slots.free                                     # one worker's read still out
    s.reported(JobReports(released=Counter({late: 1})))
    assert sorted(s.slots.free) == sorted([late, spare])
    s.slots.check()


def test_where_every_worker_copies_within_its_step_a_finished_request_keeps_no_blocks():
    s = side(workers=2, storage="none")
    s.reported(JobReports(synchronous=1))
    s.reported(JobReports(synchronous=1))
    a = Req("a", list(range(9)))
    s.matched(a, 0)
    computed(s, a, 9)                                                  # its saves not reported yet
    keep, _ = s.finished(a)
    assert not keep and not s.build({}, blocks).keep


def test_a_finished_request_whose_saves_have_not_landed_is_kept_and_the_next_plan_says_so():
    s = side(workers=2, storage="none")
    s.reported(JobReports(synchronous=1))                              # one worker of two copies in-step
    a, b = Req("a", list(range(9))), Req("b", list(range(50, 59)))
    s.matched(a, 0)
    s.matched(b, 0)
    plan = computed(s, a, 9)
    keep, _ = s.finished(a)
    assert keep and s.build({}, blocks).keep == ["a"]
    assert not s.build({}, blocks).keep                                # said once
    landed(s, plan, workers=2)
    b_plan = computed(s, b, 9)
    landed(s, b_plan, workers=2)
    assert s.finished(b) == (False, {"hicache": {"host_tokens": 0, "l3_tokens": 0, "model": "",
                                                 "fenced_preemptions": 0}})


def test_a_plan_some_worker_dropped_saves_of_holds_none_of_its_pages():
    """One worker of two reports the plan's saves failed: no page of it is loadable or
    announced, and its slots are free again."""
    s = side(workers=2, storage="none")
    a = Req("a", list(range(9)), block_hashes=[b"h0", b"h1"])
    s.matched(a, 0)
    plan = computed(s, a, 9)
    landed(s, plan)
    s.reported(JobReports(copied=Counter({plan.step: 1}), failed=Counter({plan.step: 1})))
    s.slots.check()
    assert sorted(s.slots.free) == [0, 1, 2, 3] and not s.events.take()
    assert s.matched(Req("b", list(range(9))), 0) == (0, False)


def test_a_save_names_its_block_table_only_where_its_plan_loads_one_of_those_blocks():
    """b loads a's two pages and computes two more in one step: its save carries b's blocks up
    to its last saved page (a worker drops the saves over a load that failed); c loads nothing."""
    s = side(storage="none")
    a = Req("a", list(range(9)))
    s.matched(a, 0)
    landed(s, computed(s, a, 9))
    b = Req("b", list(range(17)))
    assert s.matched(b, 0) == (8, False)
    s.allocated(b, 8)
    b.num_computed_tokens = 8
    plan = computed(s, b, 9)
    (save,) = plan.saves
    assert save.blocks == [102, 103] and save.table == [100, 101, 102, 103]
    landed(s, plan)
    c = Req("c", list(range(50, 55)))
    s.matched(c, 0)
    (save,) = computed(s, c, 5).saves
    assert save.table == []


def test_a_preemption_while_a_requests_saves_are_in_flight_is_counted_in_its_params():
    """Each worker fences the saves of a request vLLM preempts while they are in flight; its
    kv_transfer_params count those preemptions."""
    s, a = side(storage="none"), Req("a", list(range(9)))
    s.matched(a, 0)
    plan = computed(s, a, 9)
    assert s.build({}, blocks, preempted={"a"}).preempted == ["a"]
    landed(s, plan)
    s.build({}, blocks, preempted={"a"})                               # nothing in flight
    assert s.finished(a)[1]["hicache"]["fenced_preemptions"] == 1
