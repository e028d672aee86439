"""The host slots under any interleaving, searched by hypothesis.

A rule-based state machine plays vLLM around one real scheduler side and one to three real
worker sides, calling what the connector's hooks call and in vLLM's order (the connector's own
lines are a few calls each, played here, so no vLLM is needed): several requests a step, every
write policy, a host tier of two to six slots, chunked prefills, a real page store over one
shared memory L3 whose jobs finish in any order and steps late (or at once), L3 calls that
fail, and a clock that runs past prefetch deadlines. vLLM's blocks are reused as vLLM reuses
them: a preempted request's at once, a finished or aborted one's once every worker said its
saves landed; a freed block is overwritten by the next forward pass.

Saves land within their step, a step late (`late_copies`), or when the machine says (`held`:
the copy runs then, reading the blocks as they are then, as a copy stream that has not reached
it yet would; a preemption's fence runs them at once), in any order between workers; a save
may fail on one worker (its event completes with an error, its slots unwritten). No sleeps,
and no thread runs an L3 job or lands a copy unless the machine says so, so hypothesis replays
and shrinks a failure. With HICACHE_TEST_DEVICE=cuda the KV is on the GPU and the copies are
the copy engine's own, on real streams and events: landing waits for them, bounded. On CPU a
second machine runs every worker on the simulated device (the worker's `simulated_device`):
the GPU's copy code, its copies landing later than issued on stream threads; every copy's
event is waited for, bounded, when first asked, so its timing never changes what it sees.

Beside it, the reference: every token's KV row is a pure function of the tokens up to it, the
layer and the worker, so the test knows every page's bytes without the cache. After each
step every block a load filled (and no load error named) holds them, and every slot the
scheduler counts HOLDING holds them on every worker; after each backup every object it stored
reads back, verified, as them; the slot life cycle's own invariants hold; no lookup ends in an
error; and at the end every request whose blocks vLLM kept for us was given back.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import random
import time
from concurrent.futures import Future
from types import SimpleNamespace

import hicache_vllm.scheduler as scheduler_module
import pytest
import torch
from hicache_vllm.host_slots import State
from hicache_vllm.plan import Job
from hicache_vllm.scheduler import SchedulerSide
from hicache_vllm.settings import Settings
from hicache_vllm.worker import WorkerSide
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache_async.config import CacheConfig, WRITE_POLICIES
from hicache_async.errors import StorageError
from hicache_async.events import CompletionEvent, HostEvent
from hicache_async.keys import page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage import guarded
from hicache_async.storage.memory import MemoryStorage
from hicache_async.storage.wrapping import WrappingStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer.copier import CopyFailed
from hicache_async.transfer.l3_session import guarded_store
from tests.plugins.vllm.stand_ins import Req

DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"HICACHE_TEST_DEVICE={DEVICE!r}: expected cpu or cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("HICACHE_TEST_DEVICE=cuda, but no CUDA device is present", allow_module_level=True)
CUDA = DEVICE == "cuda"
LAND_TIMEOUT_S = 10.0       # CUDA: longest a landing waits for the copy engine's events

PAGE, LAYERS, HEADS, DIM, BLOCKS = 4, 2, 2, 8, 512
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
_rng = random.Random(7)
_STEMS = [[_rng.randrange(1, 500) for _ in range(4 * PAGE)] for _ in range(2)]
PROMPTS = [stem[:n] + tail for stem in _STEMS for n in (2 * PAGE, 3 * PAGE)
           for tail in ([_rng.randrange(1, 500) for _ in range(2 * PAGE + 1)],)]   # 4-6 pages, shared stems
ARRIVALS = 16           # requests a run admits at most
LANDINGS = ("in_step", "late", "held") if not CUDA else ("in_step", "late")
BUILDS = {"policy": st.sampled_from(WRITE_POLICIES), "host_pages": st.integers(2, 6), "workers": st.integers(1, 3),
          "prefetch": st.booleans(), "landing": st.sampled_from(LANDINGS)}


@functools.lru_cache(maxsize=None)
def row(prefix: tuple[int, ...], layer: int, worker: int) -> torch.Tensor:
    """The reference KV of the last token of `prefix`: [heads, dim], from nothing but its bytes."""
    digest = hashlib.sha256(repr((prefix, layer, worker)).encode()).digest()
    return torch.frombuffer(bytearray(digest[:HEADS * DIM]), dtype=torch.uint8).float().view(HEADS, DIM)


def page_ref(tokens: list[int], page: int, layer: int, worker: int) -> torch.Tensor:
    """[heads, tokens, dim] of one page, as vLLM's logical block view holds it."""
    rows = [row(tuple(tokens[:page * PAGE + j + 1]), layer, worker) for j in range(PAGE)]
    return torch.stack(rows, dim=1)


OTHER_KV = torch.full((HEADS, PAGE, DIM), -1.0)      # another request's KV, in a block vLLM gave it


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


class LookupErrors:
    """The scheduler's logger, noting each lookup that ended in an error: `matched` turns any
    exception into no hit for the request (vLLM's engine must not stop), so without this the
    machine would see a lost request, never the error."""

    EVENT = "hicache: request not cached after an error"

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []

    def warning(self, event: str, **fields) -> None:
        if event == self.EVENT:
            self.seen.append(fields)
        self.inner.warning(event, **fields)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


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
        pages = w.jobs._run(kind, job)
        w.jobs._ended(kind, job, pages)
        return pages


class Settled(CompletionEvent):
    """A simulated device's copy, complete whenever asked: the first `query` waits for it, bounded."""

    def __init__(self, event: CompletionEvent) -> None:
        self.event = event

    def query(self) -> bool:
        deadline = time.monotonic() + LAND_TIMEOUT_S
        while not self.event.query():
            assert time.monotonic() < deadline, f"a copy's event did not complete in {LAND_TIMEOUT_S} s"
            time.sleep(0.0005)
        self.error = self.event.error
        return True


class ScriptedSaves:
    """A worker's copy engine, its saves timed by the machine. `held` (CPU): a save is copied
    only when the machine lands it or a fence asks, reading the blocks as they are then.
    Otherwise the engine's own: copied at once on CPU, on its streams on CUDA, where landing
    waits for their events; on the simulated device (`settled`), each copy's event `Settled`.
    A doomed save fails: its event completes with an error, nothing written."""

    def __init__(self, engine, held: bool, settled: bool = False) -> None:
        self.engine, self.held, self.settled = engine, held, settled
        self.waiting: list[tuple[list[int], list[int], HostEvent, bool]] = []   # held, in issue order
        self.issued: list = []          # CUDA: events not yet seen complete
        self.doomed = 0                 # saves still to issue that fail

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def save(self, slots: list[int], blocks: list[int]):
        doomed, self.doomed = self.doomed > 0, max(0, self.doomed - 1)
        if self.held:
            event = HostEvent()
            self.waiting.append((list(slots), list(blocks), event, doomed))
            return event
        if doomed:
            event = HostEvent()
            event.fail(CopyFailed("scripted save failure"))
            return event
        event = self._copied(self.engine.save(slots, blocks))
        if not event.query():
            self.issued.append(event)
        return event

    def load(self, slots: list[int], blocks: list[int]):
        return self._copied(self.engine.load(slots, blocks))

    def _copied(self, event: CompletionEvent) -> CompletionEvent:
        return Settled(event) if self.settled else event

    def land(self, n: int) -> None:
        """The oldest `n` held saves are copied now (or fail); CUDA: every issued copy has
        landed once this returns."""
        self._copy_held(n)
        deadline = time.monotonic() + LAND_TIMEOUT_S
        while True:
            self.issued = [e for e in self.issued if not e.query()]
            if not self.issued:
                return
            assert time.monotonic() < deadline, f"a save's event did not complete in {LAND_TIMEOUT_S} s"
            time.sleep(0.001)

    def fence_saves(self, timeout: float) -> None:
        """Every save issued so far is copied before anything that follows the fence (CUDA: as
        the engine's own fence orders it, nothing waited for here)."""
        self._copy_held(len(self.waiting))
        self.engine.fence_saves(timeout)

    def _copy_held(self, n: int) -> None:
        for slots, blocks, event, doomed in self.waiting[:n]:
            if doomed:
                event.fail(CopyFailed("scripted save failure"))
            else:
                self._copied(self.engine.save(slots, blocks)).query()
                event.set()
        del self.waiting[:n]


class Interleavings(RuleBasedStateMachine):
    @initialize(**BUILDS)
    def build(self, policy: str, host_pages: int, workers: int, prefetch: bool = True, landing: str = "in_step",
              simulated: bool = False) -> None:
        """`prefetch` False: L3 is written, never read, so every request computes at once;
        `simulated`: the workers copy on a simulated device."""
        self.now = [0.0]        # the scheduler's deadlines and the store's breaker run on the machine's clock
        self.workers, self.portals, self.kvs, self.saves = [], [], [], []
        clock = SimpleNamespace(monotonic=lambda: self.now[0])
        self._time, scheduler_module.time, guarded.time = scheduler_module.time, clock, clock
        self._log = scheduler_module.log
        self.lookups = scheduler_module.log = LookupErrors(self._log)
        cfg = Settings(storage="memory", host_pages=host_pages, write_policy=policy, storage_timeout=0.05,
                       l3_reads="always", flush_timeout=1.0, prefetch_min_pages=1 if prefetch else 1 << 20,
                       late_copies=landing != "in_step", simulated_device=1 if simulated else None)
        self.l3 = Scripted(MemoryStorage())
        self.sched = SchedulerSide(cfg, PAGE, workers)
        for rank in range(workers):
            coords = RankCoords(tp_rank=rank, tp_size=workers)
            layout = KVLayout(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, page_size=PAGE, dtype=torch.float32,
                              axes=("head", "token", "dim"), first_head=rank * HEADS, total_kv_heads=workers * HEADS)
            kv = [torch.zeros(BLOCKS, HEADS, PAGE, DIM, device=DEVICE) for _ in range(LAYERS)]
            self.kvs.append(kv)
            w = WorkerSide(dataclasses.replace(cfg, storage="none"), layout, coords, kv)
            w.jobs.store = guarded_store(self.l3, "scripted", layout, coords, CacheConfig(storage_timeout_s=5.0))
            w.settings = cfg
            w.copies = ScriptedSaves(w.copies, held=landing == "held", settled=simulated)
            w.jobs._portal = SteppedPortal(w)
            self.workers.append(w)
            self.portals.append(w.jobs._portal)
            self.saves.append(w.copies)
        self.reqs: dict[str, dict] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.kept: dict[str, int] = {}          # finished, blocks kept for us: workers that released them
        self.finished_ids: set[str] = set()
        self.free_blocks = list(range(BLOCKS))  # the last freed is the first given again
        self.freed: set[int] = set()            # freed since the last forward pass: overwritten by it
        self.ref: dict[str, tuple[list[int], int]] = {}     # page hash -> (tokens, page index)

    def teardown(self) -> None:
        """Every copy lands and every L3 job still queued runs (and is checked) while vLLM
        steps on, until every request whose blocks were kept for us is given them back; then
        each worker closes."""
        if not hasattr(self, "_time"):
            return
        try:
            if hasattr(self, "ref"):        # (not when the build itself was cut short)
                for _ in range(6):
                    if not (self.kept or any(s.waiting for s in self.saves)):
                        break
                    self._step([], 64, True, random.Random(0))
                    for saves, portal in zip(self.saves, self.portals):
                        saves.land(len(saves.waiting))
                        while portal.queue:
                            portal.run(0)
                assert not self.kept, f"blocks of {sorted(self.kept)} never given back"
        finally:
            scheduler_module.time = guarded.time = self._time
            scheduler_module.log = self._log
            for portal, w, saves in zip(self.portals, self.workers, self.saves):
                saves.land(len(saves.waiting))
                portal.eager = True         # the flush's own backups run too
                while portal.queue:
                    portal.run(0)
                w.close()
        self._check_backups()

    # -- rules -------------------------------------------------------------------------------

    def _arrive(self, tokens: list[int]) -> None:
        rid = f"r{len(self.reqs)}"
        self.reqs[rid] = {"req": Req(rid, list(tokens)), "blocks": [], "ext": 0}
        self.waiting.append(rid)
        for i, h in enumerate(page_hashes(tokens, PAGE)):
            self.ref[h] = (tokens, i)

    @precondition(lambda self: len(self.reqs) < ARRIVALS and self.sched.slots.evictable)
    @rule(pages=st.integers(1, 2))
    def compete(self, pages: int) -> None:
        """A request arrives, first in line, whose prompt starts with the prefix of the least
        recently used page, then `pages` pages of its own: in a full tier its loadable run and
        the prefetch of the rest compete for the same slots."""
        slot = next(iter(self.sched.slots.evictable))
        tokens, page = self.ref[self.sched.slots.slots[slot].page]
        fresh = 1000 + 100 * len(self.reqs)         # outside PROMPTS' tokens: pages no one has
        self._arrive(tokens[:(page + 1) * PAGE] + list(range(fresh, fresh + pages * PAGE + 1)))
        self.waiting.insert(0, self.waiting.pop())

    def _loadable(self, req: Req) -> list[str]:
        """The request's leading pages the host tier holds now (what a lookup may load)."""
        hashes = page_hashes(req.all_token_ids, PAGE)[:(len(req.all_token_ids) - 1) // PAGE]
        run = self.sched.slots.run(hashes, 0, len(hashes))
        return hashes[:run]

    @rule(arrivals=st.lists(st.integers(0, len(PROMPTS) - 1), max_size=3),
          chunk=st.sampled_from([PAGE, 2 * PAGE + 1, 64]), eager=st.booleans(),
          order=st.randoms(use_true_random=False), preempt=st.none() | st.integers(0, 15))
    def step(self, arrivals: list[int], chunk: int, eager: bool, order: random.Random, preempt: int | None) -> None:
        """One engine step: new requests, a preemption, admissions, the plan, every worker's
        forward pass, the reports. Eager: an L3 job runs the moment it is issued, as a free
        thread would."""
        self._step(arrivals, chunk, eager, order, preempt)

    def _step(self, arrivals: list[int], chunk: int, eager: bool, order: random.Random, preempt: int | None = None) -> None:
        for prompt in arrivals[:max(0, ARRIVALS - len(self.reqs))]:
            self._arrive(PROMPTS[prompt])
        for portal in self.portals:
            portal.eager = eager
        taken = self._preempt(preempt) if preempt is not None and self.running else {}
        for rid in list(self.waiting) if not taken else ():      # vLLM admits none in a step it preempts
            r = self.reqs[rid]
            loadable = self._loadable(r["req"])
            n, _ = self.sched.matched(r["req"], 0)             # get_num_new_matched_tokens
            assert all(map(self.sched.slots.holding, loadable)) and (n is None or n >= len(loadable) * PAGE), \
                f"{rid}'s lookup lost {len(loadable)} loadable pages (hit {n})"
            if n is None:
                continue
            r["blocks"] = [self.free_blocks.pop() for _ in range(len(r["req"].all_token_ids) // PAGE + 1)]
            self.sched.allocated(r["req"], n)                  # update_state_after_alloc
            r["req"].num_computed_tokens, r["ext"] = n, n
            self.waiting.remove(rid)
            self.running.append(rid)
        scheduled = {rid: min(chunk, len(self.reqs[rid]["req"].all_token_ids) - self.reqs[rid]["req"].num_computed_tokens)
                     for rid in self.running}
        plan = self.sched.build(scheduled, lambda rid: self.reqs[rid]["blocks"], list(taken))  # build_connector_meta
        others = sorted(self.freed.intersection(self.free_blocks))      # another request's, this pass
        self.freed = set()
        reports, released = [], []
        for i in order.sample(range(len(self.workers)), len(self.workers)):
            self._forward(i, plan, scheduled, others, {block for blocks in taken.values() for block in blocks})
            released.append(self.workers[i].finished_sending(plan))    # get_finished
            reports.append(self.workers[i].reports())                  # build_connector_worker_meta
        self.finished_ids = set()
        for rid, n in scheduled.items():
            req = self.reqs[rid]["req"]
            req.num_computed_tokens += n
            if req.num_computed_tokens == len(req.all_token_ids):
                self.running.remove(rid)
                self._finish(rid)
        for sent in released:
            for rid in sent:
                assert rid in self.kept, f"{rid} reported finished sending, but its blocks were not kept"
                self.kept[rid] += 1
        for rid in [rid for rid, n in self.kept.items() if n == len(self.workers)]:
            del self.kept[rid]
            self._free(rid)
        reports = [m for m in reports if m is not None]
        total = functools.reduce(lambda a, b: a.aggregate(b), reports) if reports else None
        self.sched.reported(total)                              # update_connector_output
        self._check_backups()
        self._check_host()

    def _finish(self, rid: str) -> None:
        """vLLM is done with the request (finished or aborted): `request_finished`, which keeps
        its blocks while a save still reads them."""
        keep, _ = self.sched.finished(self.reqs[rid]["req"])
        assert keep or not self._held_reading(self.reqs[rid]["blocks"]), f"{rid}'s blocks freed under its saves"
        self.finished_ids.add(rid)
        if keep:
            self.kept[rid] = 0
        else:
            self._free(rid)

    def _held_reading(self, blocks: list[int], worker: int | None = None) -> bool:
        """Whether a held save (of `worker`, or any) still reads one of `blocks`."""
        saves = self.saves if worker is None else [self.saves[worker]]
        return any(not set(blocks).isdisjoint(held) for s in saves for _, held, _, _ in s.waiting)

    def _free(self, rid: str) -> None:
        blocks, self.reqs[rid]["blocks"] = self.reqs[rid]["blocks"], []
        self.free_blocks += blocks
        self.freed.update(blocks)

    def _preempt(self, pick: int) -> dict[str, list[int]]:
        """vLLM takes a running request's blocks (for another request's KV, this very step) and
        queues it again from its first token; the blocks it took, by request."""
        rid = self.running.pop(pick % len(self.running))
        blocks = self.reqs[rid]["blocks"]
        self._free(rid)
        self.reqs[rid]["req"].num_computed_tokens, self.reqs[rid]["ext"] = 0, 0
        self.waiting.insert(0, rid)
        return {rid: blocks}

    @precondition(lambda self: self.running or self.waiting)
    @rule(pick=st.integers(0, 15))
    def abort(self, pick: int) -> None:
        """The client goes away: vLLM finishes the request wherever it is, saves perhaps in flight."""
        queued = self.running + self.waiting
        rid = queued[pick % len(queued)]
        (self.running if rid in self.running else self.waiting).remove(rid)
        self._finish(rid)

    @precondition(lambda self: any(s.waiting or s.issued for s in self.saves))
    @rule(worker=st.integers(0, 2), n=st.integers(1, 3))
    def land(self, worker: int, n: int) -> None:
        """A worker's oldest `n` held saves land (CUDA: its issued copies are waited for)."""
        self.saves[worker % len(self.saves)].land(n)

    @rule(worker=st.integers(0, 2))
    def doom_a_save(self, worker: int) -> None:
        """The worker's next save fails."""
        self.saves[worker % len(self.saves)].doomed += 1

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
        self.sched.slots.check()
        assert not self.lookups.seen, f"a lookup ended in an error: {self.lookups.seen[0]}"
        for w in self.workers:
            assert w.acks.counts.get("slot_violations", 0) == 0

    # -- the reference -----------------------------------------------------------------------

    def _forward(self, i: int, plan, scheduled: dict[str, int], others: list[int], taken: set[int]) -> None:
        """Worker `i`'s step: preemptions (no held save may read the `taken` blocks after
        them), loads, the forward pass writing each computed token's row (and another
        request's KV into `others`, blocks vLLM freed), saves; then every block its loads
        filled is checked."""
        w, kv = self.workers[i], self.kvs[i]
        w.preempted(plan)                                  # handle_preemptions
        assert not self._held_reading(list(taken), i), f"worker {i}: a preempted request's saves not fenced"
        w.start(plan)                                      # start_load_kv
        for layer in range(len(LAYER_NAMES)):
            w.wait_layer(layer)                            # wait_for_layer_load
            if others:
                kv[layer][others] = OTHER_KV.to(DEVICE)
        for rid, n in scheduled.items():
            r = self.reqs[rid]
            tokens, start = r["req"].all_token_ids, r["req"].num_computed_tokens
            for t in range(start, start + n):
                block = r["blocks"][t // PAGE]
                for layer in range(LAYERS):
                    kv[layer][block, :, t % PAGE] = row(tuple(tokens[:t + 1]), layer, i).to(DEVICE)
        w.finish(plan)                                     # wait_for_save
        errors = w.load_errors()                           # get_block_ids_with_load_errors
        for move in plan.loads:
            r = self.reqs[move.req_id]
            for page, block in enumerate(r["blocks"][:r["ext"] // PAGE]):
                if block in errors or block not in move.blocks:
                    continue
                for layer in range(LAYERS):
                    want = page_ref(r["req"].all_token_ids, page, layer, i)
                    assert torch.equal(kv[layer][block].cpu(), want), f"{move.req_id} page {page} loaded wrong KV"

    def _check_host(self) -> None:
        """Every slot the scheduler counts HOLDING holds its page's reference on every worker."""
        for slot, s in enumerate(self.sched.slots.slots):
            if s.state is not State.HOLDING:
                continue
            tokens, page = self.ref[s.page]
            for i, w in enumerate(self.workers):
                for layer in range(LAYERS):
                    assert torch.equal(w.host.tensor[slot, layer], page_ref(tokens, page, layer, i)), \
                        f"worker {i}: slot {slot}, HOLDING page {page}, holds other bytes"

    def _check_backups(self) -> None:
        """Every object a finished backup stored reads back, verified, as the reference."""
        for i, portal in enumerate(self.portals):
            done, portal.finished = portal.finished, []
            for kind, job, pages in done:
                if kind != "backup" or not pages:
                    continue
                self._read_back(i, job, pages)

    def _read_back(self, i: int, job: Job, pages: int) -> None:
        w = self.workers[i]
        scratch = HostPool(w.layout, pages)
        fail, self.l3.fail = self.l3.fail, set()
        got = w.jobs.store.prefetch(job.hashes[:pages], scratch, list(range(pages)), tenant=job.tenant).pages
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


class SimulatedInterleavings(Interleavings):
    """The same machine, every worker copying on the simulated device."""

    @initialize(**BUILDS)
    def build(self, policy: str, host_pages: int, workers: int, prefetch: bool = True,
              landing: str = "in_step") -> None:
        super().build(policy, host_pages, workers, prefetch, landing, simulated=True)


if not CUDA:
    SimulatedInterleavings.TestCase.settings = Interleavings.TestCase.settings
    test_slot_interleavings_on_the_simulated_device = SimulatedInterleavings.TestCase
