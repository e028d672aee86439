"""Our own store evicting an object, from the file it removes to the STORAGE `BlockRemoved` a
router gets: a real worker side backs pages up into a file store too small for them, its
reports carry the evicted pages, and the real scheduler side withdraws them."""
from __future__ import annotations

import os
import time

import torch
from hicache_vllm.scheduler import RequestPages, SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from hicache_async.config import CacheConfig
from hicache_async.layout import KVLayout
from hicache_async.storage.file import FileStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store

PAGE = 4
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=16, page_size=PAGE, dtype=torch.bfloat16,
                  axes=("head", "token", "dim"))


def _request(name: str, first: int) -> Request:
    """Nine tokens of its own: two full pages."""
    init_none_hash(sha256)
    return Request(name, list(range(first, first + 9)), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(PAGE, sha256))


def _served(s: SchedulerSide, w: WorkerSide, req: Request, blocks: list[int]) -> list:
    """vLLM computes `req` in one step; the worker saves and backs it up; the events once its
    backup is reported done."""
    s.requests[req.request_id] = RequestPages(req, looked_in_l3=True)
    plan = s.build({req.request_id: 9}, lambda _: blocks)
    req.num_computed_tokens = 9
    w.start(plan)
    w.finish(plan)
    events, deadline = [], time.monotonic() + 10
    while not any(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in events):
        assert time.monotonic() < deadline, "the backup never reported"
        time.sleep(0.02)
        s.reported(w.reports())
        events += s.events.take()
    return events


def test_a_page_the_file_store_evicts_is_withdrawn_from_storage_and_forgotten(tmp_path):
    kv = [torch.randn(8, 2, PAGE, 16).to(torch.bfloat16) for _ in range(2)]
    w = WorkerSide(Settings(storage="none", host_pages=8), LAYOUT, RankCoords(), kv)
    files = FileStorage(str(tmp_path))
    w.jobs.store = guarded_store(files, "file", LAYOUT, RankCoords(), CacheConfig())
    s = SchedulerSide(Settings(storage="none", host_pages=8, l3_reads="always"), PAGE, 1)
    s.l3 = True
    a, b = _request("a", 100), _request("b", 200)
    _served(s, w, a, [0, 1, 2])
    ours = s.requests["a"].hashes
    assert list(s.l3_writes.stored) == ours
    objects = sorted(str(p) for p in tmp_path.rglob("*") if p.is_file())
    for age, path in enumerate(objects):                  # a's first page the oldest write, by its path
        first = os.path.basename(path).startswith(ours[0])
        os.utime(path, (1000 + (0 if first else 10) + age,) * 2)
    page_bytes = sum(os.path.getsize(p) for p in objects) / 2
    files.capacity_bytes = int(3.5 * page_bytes)          # b's second page overflows: a's first page goes
    events = _served(s, w, b, [3, 4, 5])
    gone = [e for e in events if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in gone] == [("STORAGE", [maybe_convert_block_hash(a.block_hashes[0])])]
    assert list(s.l3_writes.stored) == [ours[1], *s.requests["b"].hashes]
    assert ours[0] not in w.jobs.in_l3 and w.reports() is None       # said once
    w.close()
