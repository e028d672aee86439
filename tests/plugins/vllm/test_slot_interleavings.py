"""The connector's host slots under any interleaving, searched by hypothesis.

A rule-based state machine drives the connector's own hooks, as vLLM's scheduler and model
runner call them, on one scheduler side and two or three real worker sides (CPU tensors, a
real page store over one shared memory L3): several requests a step, every write policy, a
host tier of two to six slots, chunked prefills, L3 jobs that finish in any order and steps
late (or at once), L3 calls that fail, and a clock that runs past prefetch deadlines. No
sleeps, and no thread runs an L3 job unless the machine says so, so hypothesis replays and
shrinks a failure.

Beside it, the reference: every token's KV row is a pure function of the tokens up to it, the
layer and the worker, so the test knows every page's bytes without the cache. After each
step every block a load filled (and no load error named) holds them; after each backup every
object it stored reads back, verified, as them; and the slot life cycle's own invariants hold.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
from concurrent.futures import Future
from types import SimpleNamespace

import hicache_vllm.scheduler as scheduler_module
import torch
from hicache_vllm.connector import HiCacheConnector
from hicache_vllm.plan import Job
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache_async.config import CacheConfig, WRITE_POLICIES
from hicache_async.errors import StorageError
from hicache_async.keys import page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.memory import MemoryStorage
from hicache_async.storage.wrapping import WrappingStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer.l3_session import guarded_store
from tests.plugins.vllm.test_scheduler import Req

PAGE, LAYERS, HEADS, DIM, BLOCKS = 4, 2, 2, 8, 512
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
_rng = random.Random(7)
_STEMS = [[_rng.randrange(1, 500) for _ in range(4 * PAGE)] for _ in range(2)]
PROMPTS = [stem[:n] + tail for stem in _STEMS for n in (2 * PAGE, 3 * PAGE)
           for tail in ([_rng.randrange(1, 500) for _ in range(2 * PAGE + 1)],)]   # 4-6 pages, shared stems


@functools.lru_cache(maxsize=None)
def row(prefix: tuple[int, ...], layer: int, worker: int) -> torch.Tensor:
    """The reference KV of the last token of `prefix`: [heads, dim], from nothing but its bytes."""
    digest = hashlib.sha256(repr((prefix, layer, worker)).encode()).digest()
    return torch.frombuffer(bytearray(digest[:HEADS * DIM]), dtype=torch.uint8).float().view(HEADS, DIM)


def page_ref(tokens: list[int], page: int, layer: int, worker: int) -> torch.Tensor:
    """[heads, tokens, dim] of one page, as vLLM's logical block view holds it."""
    rows = [row(tuple(tokens[:page * PAGE + j + 1]), layer, worker) for j in range(PAGE)]
    return torch.stack(rows, dim=1)


class Scripted(WrappingStorage):
    """The shared L3, with failures the machine scripts."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.fail: set[str] = set()

    def _through(self, op, keys, call):
        if op in self.fail:
            self.fail.discard(op)
            raise StorageError(f"scripted {op} failure")
        return call()


class SteppedPortal:
    """Stands in for a worker's blocking portal: an L3 job runs only when the machine says."""

    def __init__(self, worker: WorkerSide) -> None:
        self.worker, self.queue, self.eager, self.finished = worker, [], False, []

    def start_task_soon(self, fn, *args) -> Future:
        future = Future()
        self.queue.append((args, future))
        if self.eager:
            self.run(len(self.queue) - 1)
        return future

    def run(self, index: int) -> None:
        args, future = self.queue.pop(index)
        kind, job = args[0], args[-1]
        try:
            pages = self._job(args)
        except StorageError:
            pages = 0
        self.finished.append((kind, job, pages))
        future.set_result(None)

    def _job(self, args) -> int:
        w = self.worker
        if len(args) == 3:      # 82bdd8f: (kind, run, job), reported through `_finished`
            _, run, job = args
            pages = run(job)
            w._finished[job.job] = pages
            return pages
        kind, job = args
        pages = w._run(kind, job)
        w._ended(kind, job, pages)
        return pages


class Interleavings(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(WRITE_POLICIES), host_pages=st.integers(2, 6), workers=st.integers(1, 3),
                prefetch=st.booleans())
    def build(self, policy: str, host_pages: int, workers: int, prefetch: bool = True) -> None:
        """`prefetch` False: L3 is written, never read, so every request computes at once."""
        self.now = [0.0]
        self._time, scheduler_module.time = scheduler_module.time, SimpleNamespace(monotonic=lambda: self.now[0])
        cfg = Settings(storage="memory", host_pages=host_pages, write_policy=policy, storage_timeout=0.05,
                       flush_timeout=1.0, prefetch_min_pages=1 if prefetch else 1 << 20)
        self.l3 = Scripted(MemoryStorage())
        self.sched = HiCacheConnector.__new__(HiCacheConnector)
        self.sched.scheduler, self.sched.worker = SchedulerSide(cfg, PAGE, workers), None
        self.sched._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (self.reqs[rid]["blocks"],))
        self.workers, self.portals, self.kvs = [], [], []
        for rank in range(workers):
            coords = RankCoords(tp_rank=rank, tp_size=workers)
            layout = KVLayout(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.float32,
                              axes=("head", "token", "dim"), first_head=rank * HEADS, total_kv_heads=workers * HEADS)
            kv = [torch.zeros(BLOCKS, HEADS, PAGE, DIM) for _ in range(LAYERS)]
            self.kvs.append(kv)
            w = WorkerSide(dataclasses.replace(cfg, storage="none"), layout, coords, kv)
            w.store = guarded_store(self.l3, "scripted", layout, coords, CacheConfig(storage_timeout_s=5.0))
            w.settings = cfg
            portal = SteppedPortal(w)
            w._portal = portal
            conn = HiCacheConnector.__new__(HiCacheConnector)
            conn.worker, conn.scheduler, conn._layer_of = w, None, {n: i for i, n in enumerate(LAYER_NAMES)}
            conn._connector_metadata = None
            self.workers.append(conn)
            self.portals.append(portal)
        self.reqs: dict[str, dict] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.kept: dict[str, int] = {}          # finished, blocks kept for us: workers that released them
        self.finished_ids: set[str] = set()
        self.next_block = 0
        self.ref: dict[str, tuple[list[int], int]] = {}     # page hash -> (tokens, page index)

    def teardown(self) -> None:
        """Every L3 job still queued runs (and is checked), then each worker closes."""
        if not hasattr(self, "_time"):
            return
        scheduler_module.time = self._time
        for portal, conn in zip(self.portals, self.workers):
            portal.eager = True         # the flush's own backups run too
            while portal.queue:
                portal.run(0)
            conn.worker.close()
            self._check_backups()

    # -- rules -------------------------------------------------------------------------------

    def _arrive(self, prompt: int) -> None:
        tokens = PROMPTS[prompt]
        rid = f"r{len(self.reqs)}"
        self.reqs[rid] = {"req": Req(rid, list(tokens)), "blocks": [], "ext": 0}
        self.waiting.append(rid)
        for i, h in enumerate(page_hashes(tokens, PAGE)):
            self.ref[h] = (tokens, i)

    @rule(arrivals=st.lists(st.integers(0, len(PROMPTS) - 1), max_size=3),
          chunk=st.sampled_from([PAGE, 2 * PAGE + 1, 64]), eager=st.booleans(),
          order=st.randoms(use_true_random=False))
    def step(self, arrivals: list[int], chunk: int, eager: bool, order: random.Random) -> None:
        """One engine step: new requests, admissions, the plan, every worker's forward pass,
        the reports. Eager: an L3 job runs the moment it is issued, as a free thread would."""
        for prompt in arrivals[:max(0, 16 - len(self.reqs))]:
            self._arrive(prompt)
        for portal in self.portals:
            portal.eager = eager
        for rid in list(self.waiting):
            r = self.reqs[rid]
            n, _ = self.sched.get_num_new_matched_tokens(r["req"], 0)
            if n is None:
                continue
            r["blocks"] = list(range(self.next_block, self.next_block + len(r["req"].all_token_ids) // PAGE + 1))
            self.next_block += len(r["blocks"])
            self.sched.update_state_after_alloc(r["req"], (r["blocks"],), n)
            r["req"].num_computed_tokens, r["ext"] = n, n
            self.waiting.remove(rid)
            self.running.append(rid)
        scheduled = {rid: min(chunk, len(self.reqs[rid]["req"].all_token_ids) - self.reqs[rid]["req"].num_computed_tokens)
                     for rid in self.running}
        out = SimpleNamespace(num_scheduled_tokens=scheduled, preempted_req_ids=set(),
                              finished_req_ids=self.finished_ids)
        plan = self.sched.build_connector_meta(out)
        reports, released = [], []
        for i in order.sample(range(len(self.workers)), len(self.workers)):
            self._forward(i, plan, scheduled)
            released.append(self.workers[i].get_finished(self.finished_ids)[0] or set())
            reports.append(self.workers[i].build_connector_worker_meta())
            self.workers[i].clear_connector_metadata()
        self.finished_ids = set()
        for rid, n in scheduled.items():
            req = self.reqs[rid]["req"]
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.all_token_ids):
                self.running.remove(rid)
                keep, _ = self.sched.request_finished(req, self.reqs[rid]["blocks"])
                self.finished_ids.add(rid)
                if keep:
                    self.kept[rid] = 0
        for sent in released:
            for rid in sent:
                assert rid in self.kept, f"{rid} reported finished sending, but its blocks were not kept"
                self.kept[rid] += 1
        self.kept = {rid: n for rid, n in self.kept.items() if n < len(self.workers)}
        reports = [m for m in reports if m is not None]
        total = functools.reduce(lambda a, b: a.aggregate(b), reports) if reports else None
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=total))
        self._check_backups()

    @rule(worker=st.integers(0, 2), pick=st.integers(0, 7))
    def finish_l3_job(self, worker: int, pick: int) -> None:
        portal = self.portals[worker % len(self.portals)]
        if portal.queue:
            portal.run(pick % len(portal.queue))
            self._check_backups()

    @rule(op=st.sampled_from(["batch_get", "batch_set", "batch_exists"]))
    def fail_next(self, op: str) -> None:
        self.l3.fail.add(op)

    @rule(seconds=st.sampled_from([0.01, 0.1]))
    def tick(self, seconds: float) -> None:
        self.now[0] += seconds

    @invariant()
    def slot_life_cycle_holds(self) -> None:
        if not hasattr(self, "sched"):
            return
        slots = getattr(self.sched.scheduler, "slots", None)
        if slots is not None:
            slots.check()
        for conn in self.workers:
            assert conn.worker.counts.get("slot_violations", 0) == 0

    # -- the reference -----------------------------------------------------------------------

    def _forward(self, i: int, plan, scheduled: dict[str, int]) -> None:
        """Worker `i`'s step: loads, the forward pass writing each computed token's row, saves;
        then every block its loads filled is checked."""
        conn = self.workers[i]
        conn.bind_connector_metadata(plan)
        conn.start_load_kv(None)
        for name in LAYER_NAMES:
            conn.wait_for_layer_load(name)
        kv = self.kvs[i]
        for rid, n in scheduled.items():
            r = self.reqs[rid]
            tokens, start = r["req"].all_token_ids, r["req"].num_computed_tokens
            for t in range(start, start + n):
                block = r["blocks"][t // PAGE]
                for layer in range(LAYERS):
                    kv[layer][block, :, t % PAGE] = row(tuple(tokens[:t + 1]), layer, i)
        conn.wait_for_save()
        errors = conn.get_block_ids_with_load_errors()
        for move in plan.loads:
            r = self.reqs[move.req_id]
            for page, block in enumerate(r["blocks"][:r["ext"] // PAGE]):
                if block in errors or block not in move.blocks:
                    continue
                for layer in range(LAYERS):
                    want = page_ref(r["req"].all_token_ids, page, layer, i)
                    assert torch.equal(kv[layer][block], want), f"{move.req_id} page {page} loaded wrong KV"

    def _check_backups(self) -> None:
        """Every object a finished backup stored reads back, verified, as the reference."""
        for i, portal in enumerate(self.portals):
            done, portal.finished = portal.finished, []
            for kind, job, pages in done:
                if kind != "backup" or not pages:
                    continue
                self._read_back(i, job, pages)

    def _read_back(self, i: int, job: Job, pages: int) -> None:
        w = self.workers[i].worker
        scratch = HostPool(w.layout, pages)
        fail, self.l3.fail = self.l3.fail, set()
        got = w.store.prefetch(job.hashes[:pages], scratch, list(range(pages)), tenant=job.tenant).pages
        self.l3.fail = fail
        assert got == pages, f"worker {i}: {pages - got} stored objects do not read back"
        for slot, h in enumerate(job.hashes[:pages]):
            tokens, page = self.ref[h]
            for layer in range(LAYERS):
                want = page_ref(tokens, page, layer, i)
                assert torch.equal(scratch.tensor[slot, layer], want), f"worker {i} stored wrong KV for page {page}"


Interleavings.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow], derandomize=True)
test_slot_interleavings = Interleavings.TestCase
