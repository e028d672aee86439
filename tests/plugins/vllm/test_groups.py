"""KV cache groups (vLLM's hybrid KV cache manager) without vLLM: a full-attention and a
sliding-window group, each its own tier; the hit is a boundary both serve, the window loads
only what its layers read there, null blocks are never copied, a save whose sliding block vLLM
took back fences the step, and no group's object is ever read by another group."""
from __future__ import annotations

from collections import Counter

import torch
from hicache_vllm.groups import GroupedScheduler
from hicache_vllm.kv_groups import Group
from hicache_vllm.kv_layout import worker_layout
from hicache_vllm.plan import NULL_BLOCK, Job, JobReports
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide

from hicache_async.config import CacheConfig
from hicache_async.keys import page_hashes
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.transfer.objects import NO_TENANT
from tests.helpers.slow_backend import SlowZeroCopy
from tests.plugins.vllm.stand_ins import Req

PAGE = 4
FULL = Group(0, "full", 0, ("model.layers.1.attn", "model.layers.3.attn"), "full")
SLIDING = Group(1, "sliding", 2 * PAGE - 1, ("model.layers.0.attn", "model.layers.2.attn"), "sliding:reach=7")
TOKENS = list(range(21))        # five full pages; a hit stops at the fifth


def grouped(workers: int = 1) -> GroupedScheduler:
    return GroupedScheduler([SchedulerSide(Settings(storage="none", host_pages=16), PAGE, workers, "", g)
                             for g in (FULL, SLIDING)])


def tables(sliding: list[int]):
    """Per request, vLLM's block ids per group: full attention 100.., the window `sliding`."""
    return lambda req_id: (list(range(100, 106)), sliding)


def landed(s: GroupedScheduler, plans) -> None:
    for side, plan in zip(s.sides, plans.plans):
        side.reported(JobReports(copied=Counter({plan.step: 1})))
        side.slots.check()


def compute(s: GroupedScheduler, req: Req, sliding: list[int]):
    assert s.matched(req, 0) == (0, False)
    plans = s.build({req.request_id: len(req.all_token_ids)}, tables(sliding))
    req.num_computed_tokens = len(req.all_token_ids)
    return plans


def test_a_window_loads_only_the_pages_its_layers_read_at_the_boundary_and_never_a_null_block():
    s = grouped()
    plans = compute(s, Req("a", TOKENS), [200, 201, 202, 203, 204, 205])
    assert [len(p.saves[0].slots) for p in plans.plans] == [5, 5]
    landed(s, plans)
    b = Req("b", TOKENS)
    assert s.matched(b, 0) == (5 * PAGE, False)
    s.allocated(b, 5 * PAGE)
    # vLLM's window table: null before the window, and (here) its first page already null too
    full, window = s.build({"b": 1}, tables([NULL_BLOCK] * 4 + [304, 305])).plans
    assert full.loads[0].blocks == [100, 101, 102, 103, 104]
    assert window.loads[0].blocks == [304] and window.loads[0].pages == s.sides[1].requests["b"].hashes[4:5]


def test_the_hit_is_the_furthest_boundary_whose_window_the_sliding_tier_holds():
    """Page 3's sliding block was null when computed (vLLM's own cache served it): only the
    full tier holds it, so the boundary at 5 pages has no window; the one at 3 has."""
    s = grouped()
    landed(s, compute(s, Req("a", TOKENS), [200, 201, 202, NULL_BLOCK, 204, 205]))
    b = Req("b", TOKENS)
    assert s.matched(b, 0) == (3 * PAGE, False)
    s.allocated(b, 3 * PAGE)
    full, window = s.build({"b": 1}, tables([NULL_BLOCK, 301, 302, 303])).plans
    assert full.loads[0].blocks == [100, 101, 102]
    assert window.loads[0].blocks == [301, 302]


def test_a_save_whose_sliding_block_vllm_took_back_fences_the_next_step():
    """Saves that have not landed (a GPU's) still read the window's blocks: once vLLM frees
    one (the window moved on) the step waits for the saves before any kernel runs."""
    s = grouped()
    compute(s, Req("a", TOKENS), [200, 201, 202, 203, 204, 205])
    full, window = s.build({"a": 1}, tables([200, 201, 202, 203, 204, 205, 206])).plans
    assert not full.fence and not window.fence
    full, window = s.build({"a": 1}, tables([NULL_BLOCK, NULL_BLOCK, 202, 203, 204, 205, 206])).plans
    assert window.fence and not full.fence


def kv(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {n: torch.randn(8, 2, PAGE, 16).to(torch.bfloat16) for n in names}


def test_no_groups_object_is_read_by_another_group():
    """Two groups with the same page shape over one store: each names its kind in its
    namespace, so a page one group stored is a miss for the other."""
    shared = SlowZeroCopy(slow_read_s=0.0)
    sides = []
    for group in (FULL, SLIDING):
        caches = kv(group.layers)
        layout = worker_layout(caches, num_blocks=8, block_size=PAGE, coords=RankCoords(), total_layers=4,
                               total_kv_heads=2, mla=False, model_id="m", engine="e", group=group)
        w = WorkerSide(Settings(storage="none", host_pages=4), layout, RankCoords(), list(caches.values()))
        w.store = guarded_store(shared, "shared", layout, RankCoords(), CacheConfig(storage_timeout_s=10.0))
        sides.append(w)
    full, sliding = sides
    assert full.layout.namespace() != sliding.layout.namespace()
    hashes = page_hashes(range(8), PAGE)
    full.host.tensor[:2] = torch.randn(2, *full.host.tensor.shape[1:]).to(torch.bfloat16)
    full.pages.update({slot: (h, NO_TENANT) for slot, h in enumerate(hashes)})
    assert full._backup(Job(0, hashes, NO_TENANT, slots=[0, 1])) == 2
    assert sliding._prefetch(Job(1, hashes, NO_TENANT, slots=[2, 3])) == 0
    assert full._prefetch(Job(2, hashes, NO_TENANT, slots=[2, 3])) == 2
    for w in sides:
        w.close()
