"""KV cache groups (vLLM's hybrid KV cache manager) without vLLM: a full-attention and a
sliding-window group, each its own tier; the hit is a boundary both serve, the window loads
only what its layers read there, null blocks are never copied, a save whose sliding block vLLM
took back fences the step, and no group's object is ever read by another group. A GDN/Mamba
state group saves only the states vLLM offers, and a hit is a boundary whose state is held:
the field's three known traps (LMCache#4247, LMCache#4843, vLLM#43090) are tests here."""
from __future__ import annotations

from collections import Counter

import torch
from hicache_vllm.groups import GroupedScheduler, GroupedWorker, GroupPlans
from hicache_vllm.kv_groups import Group
from hicache_vllm.kv_layout import worker_layout
from hicache_vllm.plan import NULL_BLOCK, Job, JobReports, StepPlan
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
        w.jobs.store = guarded_store(shared, "shared", layout, RankCoords(), CacheConfig(storage_timeout_s=10.0))
        sides.append(w)
    full, sliding = sides
    assert full.layout.namespace() != sliding.layout.namespace()
    hashes = page_hashes(range(8), PAGE)
    full.host.tensor[:2] = torch.randn(2, *full.host.tensor.shape[1:]).to(torch.bfloat16)
    full.pages.update({slot: (h, NO_TENANT) for slot, h in enumerate(hashes)})
    assert full.jobs._backup(Job(0, hashes, NO_TENANT, slots=[0, 1])) == 2
    assert sliding.jobs._prefetch(Job(1, hashes, NO_TENANT, slots=[2, 3])) == 0
    assert full.jobs._prefetch(Job(2, hashes, NO_TENANT, slots=[2, 3])) == 2
    for w in sides:
        w.close()


# -- Mamba and linear-attention (GDN) state groups, vLLM's `align` mode -------------------

STATE = Group(1, "state", PAGE, ("model.layers.0.linear_attn",), "state:reach=4:GDN_ATTN:states=3x512/bfloat16")


def hybrid() -> GroupedScheduler:
    return GroupedScheduler([SchedulerSide(Settings(storage="none", host_pages=16), PAGE, 1, "", g)
                             for g in (FULL, STATE)])


def state_tables(state: list[int]):
    return lambda req_id: (list(range(100, 106)), state)


def compute_offered(s: GroupedScheduler, req: Req, offers: list[tuple[int, int, int]], state: list[int]):
    """`req` computed in one step; vLLM offered `offers` (group, block, boundary tokens)."""
    assert s.matched(req, 0) == (0, False)
    plans = s.build({req.request_id: len(req.all_token_ids)}, state_tables(state), (), {req.request_id: offers})
    req.num_computed_tokens = len(req.all_token_ids)
    for side, plan in zip(s.sides, plans.plans):
        if plan.copies:
            side.reported(JobReports(copied=Counter({plan.step: 1})))
    return plans


def test_a_state_group_saves_only_the_state_blocks_vllm_offers_each_at_its_boundary_page():
    """The table's blocks hold running states, not the state at their page's end: only vLLM's
    offers are saved, each under the page its boundary ends, from the offered block; a
    boundary inside a page (a partial tail) is none a page names."""
    s = hybrid()
    _, state = compute_offered(s, Req("a", TOKENS), [(1, 7, 2 * PAGE), (1, 8, 5 * PAGE), (1, 11, 2 * PAGE + 1)],
                               [NULL_BLOCK, 7, NULL_BLOCK, NULL_BLOCK, 9, 10]).plans
    a = s.sides[1].requests["a"]
    assert state.saves[0].blocks == [7, 8] and state.saves[0].pages == [a.hashes[1], a.hashes[4]]


def test_shared_prefix_requests_get_only_a_state_saved_at_their_own_boundary():
    """LMCache#4247 (garbled output on shared-prefix requests of GDN hybrids): `b` shares three
    pages with `a`, whose states were saved at two and five pages. The hit stops at two pages,
    where a state of exactly that prefix is held, loaded into vLLM's block at that boundary."""
    s = hybrid()
    compute_offered(s, Req("a", TOKENS), [(1, 7, 2 * PAGE), (1, 8, 5 * PAGE)], [NULL_BLOCK] * 4 + [8, 9])
    b = Req("b", TOKENS[:3 * PAGE] + [900 + t for t in range(9)])
    assert s.matched(b, 0) == (2 * PAGE, False)
    s.allocated(b, 2 * PAGE)
    full, state = s.build({"b": 1}, state_tables([NULL_BLOCK, 301, 302])).plans
    assert full.loads[0].blocks == [100, 101]
    assert state.loads[0].blocks == [301] and state.loads[0].pages == s.sides[1].requests["b"].hashes[1:2]


def test_attention_pages_without_the_state_at_their_boundary_are_no_hit():
    """vLLM#43090 (an attention hit kept while the Mamba group misses starts the recurrence
    from an empty state): every attention page is held, no state is: nothing loads."""
    s = hybrid()
    compute_offered(s, Req("a", TOKENS), [], [NULL_BLOCK] * 5 + [9])
    b = Req("b", TOKENS)
    assert s.matched(b, 0) == (0, False)
    s.allocated(b, 0)
    assert not any(p.loads for p in s.build({"b": 1}, state_tables([NULL_BLOCK] * 5 + [9])).plans)


def test_past_a_shorter_local_hit_the_state_loaded_is_the_one_at_the_hits_end():
    """LMCache#4843 (a local hit shorter than the external one; loading a state snapshot of
    another boundary skips the transitions between): vLLM's own cache gave one page; the hit
    runs to five, attention pages 1-4 and the state at five pages, into vLLM's block there.
    With no state past the local hit's boundary there is no hit at all."""
    s = hybrid()
    compute_offered(s, Req("a", TOKENS), [(1, 7, 2 * PAGE), (1, 8, 5 * PAGE)], [NULL_BLOCK] * 4 + [8, 9])
    b = Req("b", TOKENS)
    assert s.matched(b, PAGE) == (4 * PAGE, False)
    s.allocated(b, 4 * PAGE)
    full, state = s.build({"b": 1}, state_tables([NULL_BLOCK] * 4 + [404, 405])).plans
    assert full.loads[0].blocks == [101, 102, 103, 104]
    assert state.loads[0].blocks == [404] and state.loads[0].pages == s.sides[1].requests["b"].hashes[4:5]
    s = hybrid()
    compute_offered(s, Req("a", TOKENS), [(1, 7, 2 * PAGE)], [NULL_BLOCK, 7, NULL_BLOCK, NULL_BLOCK, 9, 10])
    assert s.matched(Req("c", TOKENS), 3 * PAGE) == (0, False)


def test_a_state_groups_loads_land_before_vllm_prepares_the_pass():
    """vLLM copies a hit's state block into the running block before `start_load_kv`, and its
    GDN layers never ask for their loads: a state group's loads land in `handle_preemptions`."""
    calls = []

    class Side:
        def __init__(self, name):
            self.name, self.copies = name, self

        def preempted(self, plan):
            calls.append((self.name, "preempted"))

        def start(self, plan):
            calls.append((self.name, "start"))

        def wait_loads(self):
            calls.append((self.name, "landed"))

    w = GroupedWorker([Side("full"), Side("state")], {}, frozenset({1}))
    plans = GroupPlans([StepPlan(), StepPlan()])
    w.preempted(plans)
    assert calls == [("full", "preempted"), ("state", "preempted"), ("state", "start"), ("state", "landed")]
    w.start(plans)
    assert calls[-1] == ("full", "start") and len(calls) == 5


def test_no_state_object_is_read_as_attention_kv_or_as_a_state_of_another_shape():
    """A GDN layer's view is [blocks, 1, 1, state bytes] of int8: its namespace names the
    group's state shapes, so an attention group's object, or another state shape's, is a
    miss, never bytes read as a state."""
    shared = SlowZeroCopy(slow_read_s=0.0)
    other = Group(1, "state", PAGE, STATE.layers, "state:reach=4:MAMBA2:states=3x256/bfloat16")
    sides = []
    for group, caches in ((FULL, kv(FULL.layers)),
                          (STATE, {n: torch.zeros(8, 1, 1, 64, dtype=torch.int8) for n in STATE.layers}),
                          (other, {n: torch.zeros(8, 1, 1, 64, dtype=torch.int8) for n in STATE.layers})):
        layout = worker_layout(caches, num_blocks=8, block_size=PAGE if group.kind == "full" else 1,
                               coords=RankCoords(), total_layers=4, total_kv_heads=2, mla=False, model_id="m",
                               engine="e", group=group)
        w = WorkerSide(Settings(storage="none", host_pages=4), layout, RankCoords(), list(caches.values()))
        w.jobs.store = guarded_store(shared, "shared", layout, RankCoords(), CacheConfig(storage_timeout_s=10.0))
        sides.append(w)
    full, state, mamba = sides
    assert len({w.layout.namespace() for w in sides}) == 3
    hashes = page_hashes(range(8), PAGE)
    for w in (full, state):
        w.pages.update({slot: (h, NO_TENANT) for slot, h in enumerate(hashes)})
    assert full.jobs._backup(Job(0, hashes, NO_TENANT, slots=[0, 1])) == 2
    assert state.jobs._prefetch(Job(1, hashes, NO_TENANT, slots=[2, 3])) == 0
    assert state.jobs._backup(Job(2, hashes, NO_TENANT, slots=[0, 1])) == 2
    assert mamba.jobs._prefetch(Job(3, hashes, NO_TENANT, slots=[2, 3])) == 0
    assert state.jobs._prefetch(Job(4, hashes, NO_TENANT, slots=[2, 3])) == 2
    for w in sides:
        w.close()


def test_a_state_save_not_landed_fences_the_step_once_vllm_no_longer_holds_its_block():
    """A GPU's saves land later: once the offered state block left its request's table (vLLM
    nulls it a step on) or the request finished, the next step waits for the saves."""
    s = hybrid()
    a = Req("a", TOKENS)
    assert s.matched(a, 0) == (0, False)
    s.build({"a": len(TOKENS)}, state_tables([NULL_BLOCK] * 4 + [8]), (), {"a": [(1, 8, 5 * PAGE)]})
    a.num_computed_tokens = len(TOKENS)
    assert not s.build({"a": 1}, state_tables([NULL_BLOCK] * 4 + [8, 9])).plans[1].fence
    full, state = s.build({"a": 1}, state_tables([NULL_BLOCK] * 5 + [9])).plans
    assert state.fence and not full.fence
    s.finished(a)
    assert s.build({}, state_tables([])).plans[1].fence


def test_gdn_groups_in_align_mode_are_state_groups_named_by_their_states_and_other_states_are_refused():
    from types import SimpleNamespace

    import pytest
    from hicache_vllm.kv_groups import groups_of
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from hicache_async.errors import UsageError

    def config(mode: str, ssm=(2, 128, 128), kind="GDN_ATTN"):
        gdn = MambaSpec(block_size=160, shapes=((3, 512), ssm), dtypes=(torch.bfloat16, torch.float32),
                        mamba_type=MambaAttentionBackendEnum[kind], mamba_cache_mode=mode)
        full = FullAttentionSpec(block_size=160, num_kv_heads=1, head_size=128, dtype=torch.bfloat16)
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=gdn, layer_names=["m.layers.0.la"]),
                                                SimpleNamespace(kv_cache_spec=full, layer_names=["m.layers.1.a"])])

    state, full = groups_of(config("align"), 160)
    assert (state.kind, state.reach, full.kind) == ("state", 160, "full")
    assert "GDN_ATTN:states=3x512/bfloat16,2x128x128/float32" in state.spec
    assert groups_of(config("align", (4, 128, 128)), 160)[0].spec != state.spec
    for refused, named in ((config("none"), "mamba_cache_mode='none'"), (config("align", kind="MAMBA2"), "MAMBA2")):
        with pytest.raises(UsageError) as err:
            groups_of(refused, 160)
        assert named in str(err.value) and "\n" not in str(err.value)
