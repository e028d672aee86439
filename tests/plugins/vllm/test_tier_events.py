"""Our tiers' KV events on vLLM's own Request objects: every stored block names its tokens,
size, parent and LoRA under vLLM's hashes, in every tier, and leaves it once; and the
scheduler side sends them when what they say holds: a page is in the host tier once every
worker's save landed, and leaves L3 when a worker's store evicted it."""
from __future__ import annotations

from collections import Counter

import pytest
from hicache_vllm.plan import JobReports
from hicache_vllm.scheduler import RequestPages, SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.tier_events import TierEvents
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

PAGE = 4
OURS = ["h0", "h1", "h2"]


@pytest.fixture
def request_() -> Request:
    """13 tokens (three full blocks) under a LoRA adapter and a cache salt."""
    init_none_hash(sha256)
    return Request("r", list(range(100, 113)), SamplingParams(max_tokens=1), None, cache_salt="tenant",
                   lora_request=LoRARequest("adapter", 7, "/adapters/a"),
                   block_hasher=get_request_block_hasher(PAGE, sha256))


def vllm_hash(req: Request, page: int):
    return maybe_convert_block_hash(req.block_hashes[page])


def stored(events, medium: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def test_each_stored_block_is_named_as_vllms_own_events_name_it(request_):
    events = TierEvents(PAGE)
    events.stored(request_, [0, 1, 2], OURS, "CPU")
    blocks = stored(events.take(), "CPU")
    assert [b.block_hashes for b in blocks] == [[vllm_hash(request_, p)] for p in range(3)]
    assert [b.parent_block_hash for b in blocks] == [None, vllm_hash(request_, 0), vllm_hash(request_, 1)]
    assert [b.token_ids for b in blocks] == [list(range(100 + 4 * p, 104 + 4 * p)) for p in range(3)]
    assert all(b.block_size == PAGE and b.lora_id == 7 and b.lora_name == "adapter" for b in blocks)
    assert blocks[0].extra_keys == [("adapter", "tenant")] and blocks[1].extra_keys == [("adapter",)]
    events.stored(request_, [0, 1, 2], OURS, "CPU")
    assert not events.take()                    # announced once per tier


def test_a_backup_done_later_announces_its_pages_in_storage_with_their_tokens(request_):
    events = TierEvents(PAGE)
    events.stored(request_, [0, 1], OURS, "CPU")
    events.removed(["h0", "h1", "never-stored"], "CPU")       # write_back: they leave, then their backup ends
    events.take()
    events.stored_hashes(["h0", "h1"], "STORAGE")
    blocks = stored(events.take(), "STORAGE")
    assert [b.token_ids for b in blocks] == [[100, 101, 102, 103], [104, 105, 106, 107]]
    assert blocks[1].parent_block_hash == blocks[0].block_hashes[0] == vllm_hash(request_, 0)
    events.stored_hashes(["h0"], "STORAGE")
    events.removed(["h1"], "STORAGE")
    (gone,) = events.take()
    assert isinstance(gone, BlockRemoved) and gone.medium == "STORAGE" and gone.block_hashes == [vllm_hash(request_, 1)]


def test_a_page_leaving_the_host_tier_is_withdrawn_once_and_only_if_announced(request_):
    events = TierEvents(PAGE)
    events.stored(request_, [0], OURS, "CPU")
    events.take()
    events.removed(["h0", "h2"], "CPU")
    events.removed(["h0"], "CPU")
    (gone,) = events.take()
    assert gone.block_hashes == [vllm_hash(request_, 0)] and gone.medium == "CPU"


def test_a_prefetch_names_pages_it_never_saw_by_the_request_that_read_them(request_):
    events = TierEvents(PAGE)
    events.stored_hashes(["h0", "h1"], "STORAGE", request_, OURS)
    events.stored_hashes(["h0", "h1"], "CPU", request_, OURS)
    events.stored_hashes(["unknown"], "CPU")                   # no tokens to name it by: no event
    out = events.take()
    assert [b.token_ids[0] for b in stored(out, "STORAGE")] == [100, 104]
    assert [b.token_ids[0] for b in stored(out, "CPU")] == [100, 104] and len(out) == 4


def test_what_is_remembered_is_bounded_by_the_tiers(request_):
    events = TierEvents(PAGE, host_pages=1, l3_pages=1)
    events.stored(request_, [0, 1], OURS, "CPU")
    events.removed(["h0", "h1"], "CPU")           # only the latest page that left is kept for its backup
    events.take()
    events.stored_hashes(["h0", "h1"], "STORAGE")
    (only,) = events.take()
    assert only.block_hashes == [vllm_hash(request_, 1)]
    events.stored_hashes(["h2"], "STORAGE", request_, OURS)   # L3 remembers one page: h1 is forgotten
    events.removed(["h1", "h2"], "STORAGE")
    out = events.take()
    assert [e.block_hashes for e in out if isinstance(e, BlockRemoved)] == [[vllm_hash(request_, 2)]]


def _plain(name: str = "p") -> Request:
    """Nine tokens, no adapter: two full pages."""
    init_none_hash(sha256)
    return Request(name, list(range(200, 209)), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(PAGE, sha256))


def _scheduler(req: Request, workers: int) -> SchedulerSide:
    s = SchedulerSide(Settings(storage="none", host_pages=4, l3_reads="always"), PAGE, workers)
    s.l3 = True                                 # it plans backups; the test reports them
    s.requests[req.request_id] = RequestPages(req, looked_in_l3=True)
    return s


def test_a_save_is_announced_in_the_host_tier_only_once_every_worker_reported_it_landed():
    req = _plain()
    s = _scheduler(req, workers=2)
    plan = s.build({"p": 9}, lambda _: [7, 8, 9])
    assert [m.blocks for m in plan.saves] == [[7, 8]]
    assert stored(s.events.take(), "CPU") == []                 # planned, not landed
    s.reported(JobReports(copied=Counter({plan.step: 1})))
    assert stored(s.events.take(), "CPU") == []                 # one worker of two
    s.reported(JobReports(copied=Counter({plan.step: 1})))
    assert [b.block_hashes for b in stored(s.events.take(), "CPU")] == [[vllm_hash(req, 0)], [vllm_hash(req, 1)]]


def test_an_eviction_a_worker_reports_withdraws_the_page_from_storage_after_its_backup_is_announced():
    req = _plain()
    s = _scheduler(req, workers=2)
    plan = s.build({"p": 9}, lambda _: [7, 8, 9])
    (backup,) = plan.backups
    h0, h1 = s.requests["p"].hashes
    s.reported(JobReports(copied=Counter({plan.step: 2})))
    s.events.take()
    s.reported(JobReports({backup.job: (1, 2)}))
    s.reported(JobReports({backup.job: (1, 2)}, evicted={h0, "not-announced"}))   # stored, then evicted
    out = s.events.take()
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in out] == [
        ("BlockStored", "STORAGE", [vllm_hash(req, 0)]), ("BlockStored", "STORAGE", [vllm_hash(req, 1)]),
        ("BlockRemoved", "STORAGE", [vllm_hash(req, 0)])]
    assert list(s.l3_writes.stored) == [h1]
    s.reported(JobReports(evicted={h0}))
    assert s.events.take() == [] and list(s.l3_writes.stored) == [h1]      # withdrawn once
