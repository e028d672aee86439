"""The worker side over a real page store and CPU tensors: L3 jobs with a backend that lands
reads late or writes slowly, and copies landing on events the test sets."""
from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import torch
from hicache_vllm.plan import Job, Move, StepPlan
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide

from hicache_async.config import CacheConfig
from hicache_async.events import HostEvent
from hicache_async.keys import page_hashes
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.transfer.objects import NO_TENANT
from tests.helpers.slow_backend import SlowWrites, SlowZeroCopy

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.bfloat16,
                  axes=("head", "token", "dim"))


def kv_blocks() -> list[torch.Tensor]:
    """Per layer, eight random blocks."""
    return [torch.randn(8, 2, 4, 16).to(torch.bfloat16) for _ in range(2)]


def writer(kv: list, write_s: float = 0.0, **settings) -> WorkerSide:
    """A worker whose L3 (`w.l3`) writes each take `write_s`."""
    w = WorkerSide(Settings(**{"storage": "none", "host_pages": 8, **settings}), LAYOUT, RankCoords(), kv)
    w.l3 = SlowWrites(slow_write_s=write_s)
    w.jobs.store = guarded_store(w.l3, "slow", LAYOUT, RankCoords(), CacheConfig(storage_timeout_s=10.0))
    return w


def held_saves(w: WorkerSide) -> list[HostEvent]:
    """The worker's saves still copy at once, but land only when the test sets their events."""
    events, save = [], w.copies.save

    def held(slots, blocks):
        save(slots, blocks)
        events.append(HostEvent())
        return events[-1]
    w.copies.save = held
    return events


def worker(read_s: float, timeout_s: float) -> tuple[WorkerSide, SlowZeroCopy]:
    kv = [torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    w = WorkerSide(Settings(storage="none", host_pages=8), LAYOUT, RankCoords(), kv)
    slow = SlowZeroCopy(slow_read_s=read_s)
    w.jobs.store = guarded_store(slow, "slow", LAYOUT, RankCoords(), CacheConfig(storage_timeout_s=timeout_s))
    return w, slow


def stored(w: WorkerSide) -> list[str]:
    """Four random pages backed up from host slots 0-3; their hashes."""
    hashes = page_hashes(range(16), 4)
    w.host.tensor[:4] = torch.randn(4, *w.host.tensor.shape[1:]).to(torch.bfloat16)
    w.pages.update({slot: (h, NO_TENANT) for slot, h in enumerate(hashes)})
    assert w.jobs._backup(Job(0, hashes, NO_TENANT, slots=[0, 1, 2, 3])) == 4
    return hashes


def test_a_prefetch_reads_verified_pages_straight_into_its_slots():
    w, _ = worker(read_s=0.0, timeout_s=5.0)
    hashes = stored(w)
    expected = w.host.tensor[:4].clone()
    assert w.jobs._prefetch(Job(1, hashes, NO_TENANT, slots=[7, 6, 5, 4])) == 4
    assert torch.equal(w.host.tensor[[7, 6, 5, 4]], expected)
    first = w.reports()                             # a CPU worker's copies land within its step: said once
    assert first.synchronous == 1 and not first.held and not first.done and not first.copied
    assert w.reports() is None                      # nothing held: every read returned in time


def test_a_read_given_up_on_reports_its_slots_held_until_it_returns():
    w, slow = worker(read_s=1.0, timeout_s=0.2)
    hashes = stored(w)
    assert w.jobs._prefetch(Job(1, hashes, NO_TENANT, slots=[4, 5, 6, 7])) == 0   # a miss: past its deadline
    assert w.reports().held == Counter({4: 1, 5: 1, 6: 1, 7: 1})
    deadline = time.monotonic() + 10
    while slow.late_reads == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    report = w.reports()
    assert slow.late_reads == 1 and report.released == Counter({4: 1, 5: 1, 6: 1, 7: 1})
    w.close()


def test_a_save_into_a_slot_a_backup_reads_is_dropped_and_counted():
    """Two backups read slot 0 (the first one slowly, slot 0 last). The scheduler never plans a
    save into it then; if a plan did, the worker drops that page rather than let a backup store
    the new page under the old key, and counts it: L3 holds each page's own bytes."""
    kv = kv_blocks()
    w = writer(kv, write_s=0.1)
    w.host.tensor[:] = torch.randn(*w.host.tensor.shape).to(torch.bfloat16)
    before = w.host.tensor.clone()
    hashes = page_hashes(range(20), 4)
    w.pages.update({slot: (h, NO_TENANT) for slot, h in zip([4, 5, 6, 7, 0], hashes)})
    w.finish(StepPlan(step=1, backups=[Job(0, hashes, NO_TENANT, slots=[4, 5, 6, 7, 0]),
                                       Job(1, hashes[4:], NO_TENANT, slots=[0])]))
    w.finish(StepPlan(step=2, saves=[Move("r", [0, 1], [3, 4], ["new", "other"])]))
    assert w.acks.counts["slot_violations"] == 1
    assert torch.equal(w.host.tensor[0], before[0]) and torch.equal(w.host.tensor[1, 0], kv[0][4])
    w.close()                                                     # every backup done
    assert w.jobs._prefetch(Job(2, hashes[:5], NO_TENANT, slots=[1, 2, 3, 4, 5])) == 5
    assert torch.equal(w.host.tensor[[1, 2, 3, 4, 5]], before[[4, 5, 6, 7, 0]])
    assert w.jobs._prefetch(Job(3, hashes[4:], NO_TENANT, slots=[6])) == 1      # the second backup of slot 0
    assert torch.equal(w.host.tensor[6], before[0])


def test_a_load_from_a_slot_that_holds_another_page_is_a_load_error():
    kv = kv_blocks()
    w = writer(kv)
    w.finish(StepPlan(step=1, saves=[Move("r", [2, 3], [5, 6], ["p", "q"])]))
    zeros = kv[0][1].clone().zero_()
    kv[0][0:2], kv[1][0:2] = zeros, zeros
    w.start(StepPlan(step=2, loads=[Move("s", [2, 3], [0, 1], ["p", "not q"])]))
    w.finish(StepPlan(step=2))
    assert w.load_errors() == {1} and w.acks.counts["slot_violations"] == 1
    assert torch.equal(kv[0][0], kv[0][5]) and torch.equal(kv[1][0], kv[1][5])   # p: loaded
    assert torch.equal(kv[0][1], zeros) and torch.equal(kv[1][1], zeros)         # not another page's bytes
    w.close()


def test_a_load_does_not_wait_for_a_backup_reading_its_slot():
    kv = [torch.zeros(8, 2, 4, 16, dtype=torch.bfloat16) for _ in range(2)]
    w = writer(kv, write_s=2.0)
    page = page_hashes(range(4), 4)[0]
    w.host.tensor[2] = torch.randn(*w.host.tensor.shape[1:]).to(torch.bfloat16)
    w.pages[2] = (page, NO_TENANT)
    w.finish(StepPlan(step=1, backups=[Job(0, [page], NO_TENANT, slots=[2])]))
    started = time.monotonic()
    w.start(StepPlan(step=2, loads=[Move("r", [2], [5], [page])]))
    w.copies.wait_loads()
    assert time.monotonic() - started < 1.0 and w.backup_queue() == 1      # the backup still reads slot 2
    assert torch.equal(kv[0][5], w.host.tensor[2, 0]) and torch.equal(kv[1][5], w.host.tensor[2, 1])
    w.close()


def test_a_kept_request_is_reported_finished_only_once_its_saves_landed():
    w = writer(kv_blocks())
    events = held_saves(w)
    w.finish(StepPlan(step=1, saves=[Move("r", [0], [3], ["p"])]))
    assert w.finished_sending(StepPlan(step=2, keep=["r", "idle"])) == {"idle"}     # "idle" saves nothing
    assert not w.reports().copied
    assert w.finished_sending(StepPlan(step=3)) == set()
    events[0].set()
    assert w.finished_sending(StepPlan(step=4)) == {"r"}
    assert w.reports().copied == Counter({1: 1})
    assert w.finished_sending(StepPlan(step=5)) == set()                          # once
    w.close()


def test_a_backup_of_a_plans_saves_starts_only_once_they_landed_and_stores_their_bytes():
    kv = kv_blocks()
    w = writer(kv)
    events = held_saves(w)
    hashes = page_hashes(range(8), 4)
    w.finish(StepPlan(step=1, saves=[Move("r", [0, 1], [3, 4], hashes, NO_TENANT)],
                      backups=[Job(7, hashes, NO_TENANT, slots=[0, 1], after_save=True)]))
    time.sleep(0.2)
    assert not w.l3.objects and w.backup_queue() == 0 and not w.reports().done
    events[0].set()
    done, deadline = {}, time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        report = w.reports()
        done = report.done if report is not None else {}
        time.sleep(0.02)
    assert done == {7: (1, 2)}
    assert w.jobs._prefetch(Job(8, hashes, NO_TENANT, slots=[5, 6])) == 2
    assert torch.equal(w.host.tensor[5, 0], kv[0][3]) and torch.equal(w.host.tensor[6, 1], kv[1][4])
    w.close()


def test_a_preempted_requests_saves_are_fenced_at_once_and_land_later():
    """vLLM reuses a preempted request's blocks in the next forward pass: its saves in flight
    are fenced (`BlockCopies.fence_saves`: issued, and ordered before the compute stream's next
    kernels), not waited for; they land, and are reported, as any other."""
    w = writer(kv_blocks(), storage_timeout=5.0)
    events = held_saves(w)
    fences = []
    w.copies.fence_saves = fences.append
    w.finish(StepPlan(step=1, saves=[Move("r", [0], [3], ["p"])]))
    started = time.monotonic()
    w.preempted(StepPlan(step=2, preempted=["other"]))              # nothing of its in flight: no fence
    assert not fences
    w.preempted(StepPlan(step=2, preempted=["r"]))
    assert time.monotonic() - started < 0.15 and len(fences) == 1 and w._saving["r"]
    events[0].set()
    w.preempted(StepPlan(step=3, preempted=["r"]))                  # landed: nothing to fence
    assert len(fences) == 1 and not w._saving["r"] and w.acks.counts["fenced_preemptions"] == 1
    w.close()


def test_under_late_copies_a_cpu_workers_copies_land_one_plan_later():
    """The test mode that runs vLLM's deferred frees on CPU: a plan's copies are reported
    landed only once a later plan reached the worker, and it never says it copies in-step."""
    w = writer(kv_blocks(), late_copies=True)
    w.finish(StepPlan(step=1, saves=[Move("r", [0], [3], ["p"])]))
    first = w.reports()
    assert first is None or (not first.copied and not first.synchronous)
    assert w.finished_sending(StepPlan(step=1, keep=["r"])) == set()
    assert w.finished_sending(StepPlan(step=2)) == {"r"}
    assert w.reports().copied == Counter({1: 1})
    w.close()


def test_a_backup_with_no_store_leaves_its_slot_writable():
    """L3 unreachable at start (storage_optional, the default): the scheduler still plans
    backups, each ends at once with nothing stored, and the slot takes the next save."""
    kv = kv_blocks()
    w = WorkerSide(Settings(storage="none", host_pages=8), LAYOUT, RankCoords(), kv)
    w.finish(StepPlan(step=1, saves=[Move("r", [0], [3], ["p"], NO_TENANT)],
                      backups=[Job(0, ["p"], NO_TENANT, slots=[0], after_save=True)]))
    assert w.reports().done == {0: (1, 0)}
    w.finish(StepPlan(step=2, saves=[Move("s", [0], [4], ["q"], NO_TENANT)]))
    assert w.acks.counts["slot_violations"] == 0 and torch.equal(w.host.tensor[0, 0], kv[0][4])
    w.close()


WITHOUT_VLLM = """
import sys
sys.modules["vllm"] = None                  # every import of vLLM fails, as on a machine without it
from types import SimpleNamespace
import torch
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords

layout = KVLayout(num_layers=2, kv_heads=2, head_dim=16, page_size=4, dtype=torch.float32, axes=("head", "token", "dim"))
kv = [torch.randn(8, 2, 4, 16) for _ in range(2)]
cfg = Settings(storage="none", host_pages=4)
s, w = SchedulerSide(cfg, 4, 1), WorkerSide(cfg, layout, RankCoords(), kv)

def req(rid):
    return SimpleNamespace(request_id=rid, all_token_ids=list(range(9)), num_prompt_tokens=9, cache_salt=None,
                           num_computed_tokens=0, block_hashes=[], lora_request=None, prompt_embeds=None,
                           mm_features=[])

def step(scheduled, blocks):
    plan = s.build(scheduled, lambda rid: blocks)
    w.start(plan)
    for layer in range(2):
        w.wait_layer(layer)
    w.finish(plan)
    s.reported(w.reports())
    return plan

a, b = req("a"), req("b")
assert s.matched(a, 0) == (0, False)
step({"a": 9}, [0, 1, 2])
assert s.matched(b, 0) == (8, False)
s.allocated(b, 8)
(load,) = step({"b": 1}, [5, 6, 7]).loads
assert load.blocks == [5, 6] and all(torch.equal(t[5:7], t[0:2]) for t in kv)
w.close()
assert not [m for m, mod in sys.modules.items() if m.split(".")[0] == "vllm" and mod is not None]
print("ran without vllm")
"""


def test_the_scheduler_and_worker_sides_run_a_step_without_vllm():
    """A GPU machine for tests has torch and no vLLM: both sides import and carry out steps
    (a save, then a load of it into other blocks) with every import of vLLM failing."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_VLLM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ran without vllm" in done.stdout, done.stderr[-3000:]


def test_simulated_device_copies_cpu_kv_on_the_devices_streams_landing_on_events():
    """`simulated_device`: the GPU's copy path over CPU KV, so the worker reports landings late."""
    kv = kv_blocks()
    w = WorkerSide(Settings(storage="none", host_pages=8, simulated_device=5), LAYOUT, RankCoords(), kv)
    assert w.copies.streamed and not w.acks.synchronous
    saved = w.copies.save([2], [6])
    deadline = time.monotonic() + 10
    while not saved.query() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert saved.query() and saved.error is None
    assert all(torch.equal(w.host.tensor[2, layer], kv[layer][6]) for layer in range(2))
    w.close()
