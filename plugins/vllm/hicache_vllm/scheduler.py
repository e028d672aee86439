"""The scheduler side: decides, per request and per step, what the workers move.

A prompt's pages are named by our chained page hash over its token ids and everything else
that decides their KV (`request_keys.py`), so a new process, or another engine over the same
L3, names them alike, and a request with another adapter or other embeddings names them apart. A request whose prefix
runs on past vLLM's own cache and our host tier waits one step while the workers read the
rest from L3 straight into host slots taken for it, each object verified; the hit vLLM then loads is only what every
worker verified, so a missing, corrupt, forged or stale object shortens the hit and never
becomes KV; a read that outlasts `storage_timeout` is not waited for (the prefix is
recomputed). Host-tier hits load layer by layer, beside the forward pass.

Every host slot changes state only through `HostSlots` (`host_slots.py`), on the workers'
reports: a saved page is loadable and backed up once its copy landed on every worker, a slot
is reused once every load and backup reading it is done. A save never waits: where no slot
is free, its pages skip the tier.

A prefix is read from L3 only where the read is expected to finish before computing it would
(`l3_reads.py`); pages are written to L3 as the write policy says (`l3_writes.py`). What a
group's block tables hold is its kind's (`block_tables.py`).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import structlog

from hicache_async.keys import tenant_digest

from .block_tables import BlockTables
from .first_tokens import FirstTokens
from .host_slots import HostSlots
from .kv_groups import Group
from .l3_reads import L3Reads
from .l3_writes import KNOWN_PAGES, L3Writes
from .plan import Job, JobReports, Move, StepPlan
from .request_keys import RequestKeys, reads_external
from .request_pages import RequestPages
from .settings import Settings
from .tier_events import TierEvents

log = structlog.get_logger(__name__)


@dataclass
class PlanCopies:
    """A plan's loads and saves, until every worker reported them landed."""

    loads: list[tuple] = field(default_factory=list)                  # reader tokens
    saves: list[tuple[RequestPages, list[int], list[int]]] = field(default_factory=list)  # (request, pages, slots)
    reads: list[tuple[str, int, int]] = field(default_factory=list)   # a sliding window's (request, page, block)


class SchedulerSide:
    def __init__(self, settings: Settings, page_size: int, workers: int, model_id: str = "",
                 group: Group | None = None, page_bytes: int = 1 << 20) -> None:
        self.settings, self.page_size, self.workers, self.model_id = settings, page_size, workers, model_id
        self.ttft = FirstTokens()
        self.tables = BlockTables(group, page_size)
        self.slots = HostSlots(settings.host_pages)
        self.keys = RequestKeys(page_size)
        self.l3 = settings.storage != "none"
        self.clock = time.monotonic
        self.requests: dict[str, RequestPages] = {}
        self.loading: dict[str, RequestPages] = {}      # allocated loads no plan has carried yet
        self.jobs: dict[int, tuple[Job, str, float]] = {}   # unfinished, with their kind and start
        self.copying: dict[int, PlanCopies] = {}        # plans whose copies not every worker reported
        self.keep: list[str] = []                       # finished requests whose blocks vLLM keeps for us
        self.synchronous = 0                            # workers whose copies land within their step
        self.reports = JobReports()                     # of what not every worker has reported yet
        self.l3_writes = L3Writes(settings, self.slots, self._job)
        self.plan = StepPlan()
        self.events = TierEvents(page_size, settings.host_pages, KNOWN_PAGES)
        self.counts = {"host_hit_tokens": 0, "l3_hit_tokens": 0, "l3_prefetched_pages": 0, "l3_looked_pages": 0,
                       "l3_declined_pages": 0}     # declined: runs recomputing was expected to beat reading
        self.l3_reads = L3Reads(settings, page_size, page_bytes, self.counts)
        self._ids = itertools.count()
        self._steps = itertools.count(1)

    # -- vLLM's questions ----------------------------------------------------------------

    def matched(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's question: how many tokens past its own cache can we give? Any error on the
        way is no hit for this request, logged once, never a stopped engine."""
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as exc:    # noqa: BLE001 - a lookup must never stop the engine core
            st = self.requests.setdefault(request.request_id, RequestPages(request))
            if st.keyed:
                log.warning("hicache: request not cached after an error", request=request.request_id,
                            error=f"{type(exc).__name__}: {exc}")
            st.keyed, st.job = False, None
            self._unload(st)
            return 0, False

    def _matched(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestPages(request)
        self.ttft.asked(request, st)        # (`groups.py` makes `st` before this)
        st.device = num_computed_tokens
        if st.extend(self.keys) is None:
            return None, False              # its keys are still being made
        if not st.looked_in_l3:
            self._use(st, range(min(num_computed_tokens // self.page_size, len(st.hashes))))  # device hits
        if st.job is not None:
            if not self._overdue(st.job):
                return None, False          # its L3 read is still under way
            st.job = None                   # not worth waiting for: recompute
        self._unload(st)
        if not st.keyed or not reads_external(request):
            st.looked_in_l3 = True
            return 0, False
        stop = min(len(st.hashes), (request.num_prompt_tokens - 1) // self.page_size,
                   len(st.hashes) if st.limit is None else st.limit)
        start = st.start = num_computed_tokens // self.page_size
        first, run = self.tables.loadable(self.slots, st.hashes, start, stop) if start < stop else (start, 0)
        if run:     # held from now: no take, the request's own prefetch's included, may evict them
            slots, token = self.slots.touch(st.hashes[first:start + run]), ("load", next(self._ids))
            self.slots.read(token, slots)
            st.load = (first, slots, token)
        missing = stop - start - run
        if self.l3 and not st.looked_in_l3 and missing >= self.settings.prefetch_min_pages:
            st.looked_in_l3 = True
            reads = self.tables.first_read(start + run, stop)
            if self.l3_reads.pays(stop - reads) and self._prefetch(st, st.hashes[reads:stop]):
                return None, False          # the run stays held while the rest is read
        st.looked_in_l3 = True
        return run * self.page_size, False

    def allocated(self, request, num_external_tokens: int) -> None:
        st = self.requests.get(request.request_id)
        if st is None or st.load is None:
            return
        if not num_external_tokens:
            self._unload(st)
            return
        first, slots, token = st.load
        end = st.start + num_external_tokens // self.page_size
        if self.tables.window is None:
            slots = slots[:end - first]
        elif first + len(slots) != end:     # a window serves only the boundary it ends at
            self.slots.done(token)
            slots, st.unfilled = [], (st.start, end)
        st.load = (first, slots, token)
        self.loading[request.request_id] = st   # vLLM counts these tokens computed: the load must happen
        pages = st.hashes[first:first + len(slots)]
        from_l3 = self.slots.used_from_l3(pages)   # used once: a later use is a host hit
        st.from_host += len(slots) * self.page_size
        st.from_l3 += from_l3 * self.page_size
        self.counts["host_hit_tokens"] += len(slots) * self.page_size
        self.counts["l3_hit_tokens"] += from_l3 * self.page_size
        self._use(st, range(first, first + len(slots)))

    def build(self, scheduled: dict[str, int], block_ids, preempted=()) -> StepPlan:
        """This step's plan: what was decided since the last one (prefetches, backups), the
        loads decided at allocation, and the saves of every page this step completes."""
        plan, self.plan = self.plan, StepPlan()
        plan.step, copies = next(self._steps), PlanCopies()
        plan.tokens = sum(scheduled.values())
        for req_id in [r for r in self.loading if r in scheduled]:
            st = self.loading.pop(req_id)
            first, slots, token = st.load
            table = block_ids(req_id)
            blocks = table[first:first + len(slots)]
            plan.loads.append(Move(req_id, slots, blocks, st.hashes[first:first + len(slots)]).keeping(
                [self.tables.live(b) for b in blocks]))       # vLLM's window may start later than ours
            copies.loads.append(token)
            st.load = None
            if st.unfilled is not None:
                plan.unfilled += [b for b in table[slice(*st.unfilled)] if self.tables.live(b)]
                st.unfilled = None
        loaded = {block for move in plan.loads for block in move.blocks}
        for req_id, n in scheduled.items():
            st = self.requests.get(req_id)
            if st is not None:
                self._save(plan, copies, st, st.request.num_computed_tokens + n, block_ids, loaded)
        if plan.copies:
            self.copying[plan.step] = copies
        plan.fence = self.tables.reused((read for c in self.copying.values() for read in c.reads),
                                        lambda r: block_ids(r) if r in self.requests else None)
        plan.keep, self.keep = self.keep, []
        plan.preempted = list(preempted)
        for st in filter(None, map(self.requests.get, plan.preempted)):
            st.fenced += self._saving(st)
        plan.idle = not scheduled
        return plan

    def finished(self, request) -> tuple[bool, dict]:
        """Whether vLLM must keep the request's blocks until the workers say its saves landed
        (`get_finished`: never where every worker's copies land within their step, as on a
        CPU), and what its `kv_transfer_params` say of where its prefix came from and of the
        preemptions that took its blocks while its saves were in flight."""
        st = self.requests.pop(request.request_id, None)
        self.ttft.finished(request.request_id)
        if st is None:
            return False, {}
        if self.loading.pop(request.request_id, None) is not None or st.load is not None:
            self._unload(st)
        saving = self.synchronous < self.workers and self._saving(st)
        if saving:
            self.keep.append(request.request_id)
        return saving, {"hicache": {"host_tokens": st.from_host - st.from_l3, "l3_tokens": st.from_l3,
                                    "model": self.model_id, "fenced_preemptions": st.fenced}}

    def reported(self, reports: JobReports | None) -> None:
        """Fold the workers' reports in; a plan or job every worker reported is done. Pages a
        worker's store evicted are withdrawn from L3 after the finished jobs announce theirs, so
        a page stored and then evicted within one report is not left announced."""
        if reports is None:
            return
        self.l3_reads.learn(reports)
        for slot, n in reports.held.items():
            self.slots.late(slot, n)
        for slot, n in reports.released.items():
            self.slots.late(slot, -n)
        self.synchronous += reports.synchronous
        self.reports = self.reports.aggregate(JobReports(reports.done, reports.copied, failed=reports.failed))
        for step in [s for s, seen in self.reports.copied.items() if seen >= self.workers]:
            del self.reports.copied[step]
            self._copied(step, failed=bool(self.reports.failed.pop(step, 0)))
        for job in [job for job, (seen, _) in self.reports.done.items() if seen >= self.workers]:
            self._done(job, self.reports.done.pop(job)[1])
        self.l3_writes.evicted(reports.evicted)
        self.events.removed(sorted(reports.evicted), "STORAGE")

    def first_tokens(self) -> None:
        """After vLLM took a step's output: each request's first token, timed (`first_tokens.py`)."""
        self.ttft.first_tokens()

    def observed(self) -> dict:
        """For the stats: first-token seconds by tier since the last call (samples), and the
        cost model's estimates (gauges)."""
        return {**self.ttft.take(), **(self.l3_reads.estimates() if self.l3 else {})}

    def close(self) -> None:
        """At shutdown: one line for the backups decided but never delivered to a worker."""
        undelivered = sum(len(job.hashes) for job in self.plan.backups)
        if undelivered:
            log.warning("hicache shutdown: backups never delivered to a worker; their pages are not in L3",
                        pages=undelivered)

    # -- plans -----------------------------------------------------------------------------

    def _job(self, plan_list: list[Job], kind: str, hashes: list[str], tenant: bytes, slots: list[int] = (),
             req_ids: list[str] = ()) -> Job:
        """A job for the workers; a prefetch's requests wait for it."""
        job = Job(next(self._ids), hashes, tenant, list(slots), list(req_ids))
        self.jobs[job.job] = (job, kind, self.clock())
        plan_list.append(job)
        return job

    def _take(self, plan: StepPlan, n: int) -> list[int]:
        """`n` host slots at most, FREE now; under write_back, pages that leave reach L3 first,
        in `plan` (their slots serve a later step)."""
        backup = ("leaving",)       # holds the leaving slots till their backups read them
        slots, leaving = self.slots.take(n, lambda h: self.l3 and self.l3_writes.leaves_through_l3(h), backup)
        self.events.removed(self.slots.evicted(), "CPU")
        self.l3_writes.leaving(plan, leaving)
        self.slots.done(backup)     # the backups read the leaving slots now
        return slots

    def _prefetch(self, st: RequestPages, hashes: list[str]) -> bool:
        """Read `hashes` from L3 into host slots taken for it now; False when no slot is free."""
        slots = self._take(self.plan, len(hashes))
        if not slots:
            return False
        hashes = hashes[:len(slots)]
        tenant = tenant_digest(st.request.cache_salt)
        st.job = self._job(self.plan.prefetches, "prefetch", hashes, tenant, slots,
                           req_ids=[st.request.request_id]).job
        for h, slot in zip(hashes, slots):
            self.slots.fill(slot, h, tenant, st.job, indexed=False)
        self.counts["l3_looked_pages"] += len(hashes)
        return True

    def _overdue(self, job_id: int) -> bool:
        """A prefetch not every worker reported within `storage_timeout`: a hung call, or a
        worker that never answers, costs a recompute, not a request parked for ever."""
        job = self.jobs.get(job_id)
        return job is None or self.clock() - job[2] > self.settings.storage_timeout

    def _save(self, plan: StepPlan, copies: PlanCopies, st: RequestPages, computed: int, block_ids,
              loaded: set[int]) -> None:
        """Host slots for the request's pages that this step completes, not yet in the tier;
        with its block table up to them where this plan loads one of those blocks (a worker
        drops the saves a failed load spoils)."""
        if not st.extend(self.keys):
            return
        full = min(computed // self.page_size, len(st.hashes))
        blocks = self.tables.saveable(st.request.request_id, block_ids(st.request.request_id))
        todo = [p for p in range(st.saved, full) if not self.slots.has(st.hashes[p]) and self.tables.live(blocks[p])]
        st.saved = max(st.saved, full)
        if not todo:
            return
        slots = self._take(plan, len(todo))
        if not slots:
            return      # every slot is read, filling or leaving: these pages skip the tier
        todo = todo[:len(slots)]
        pages = [st.hashes[p] for p in todo]
        tenant = tenant_digest(st.request.cache_salt)
        table = blocks[:todo[-1] + 1] if loaded else []
        plan.saves.append(Move(st.request.request_id, slots, [blocks[p] for p in todo], pages, tenant,
                               table if not loaded.isdisjoint(table) else []))
        for h, slot in zip(pages, slots):
            self.slots.fill(slot, h, tenant, ("save", plan.step), indexed=True)
        copies.saves.append((st, todo, slots))
        if self.tables.window is not None:  # vLLM frees these blocks as the window moves on, saved or not
            copies.reads += [(st.request.request_id, p, blocks[p]) for p in todo]
        self._use(st, todo)
        if self.l3:
            self.l3_writes.saved(plan, pages, slots, tenant, [st.request.request_id])

    def _copied(self, step: int, failed: bool) -> None:
        """Every worker's copies of plan `step` landed: its loads' slots are free to go, its
        saved pages are in the tier (and announced), unless some worker dropped some of its
        saves (`failed`): then none holds on every worker's word, and their slots are freed."""
        copies = self.copying.pop(step)
        for token in copies.loads:
            self.slots.done(token)
        for st, todo, slots in copies.saves:
            held = set(self.slots.filled(("save", step), slots, verified=0 if failed else None))
            self.events.stored(st.request, [p for p in todo if st.hashes[p] in held], st.hashes, "CPU")

    def _saving(self, st: RequestPages) -> bool:
        """Whether some of the request's saves have not landed on every worker yet."""
        return any(s is st for copies in self.copying.values() for s, _, _ in copies.saves)

    def _unload(self, st: RequestPages) -> None:
        """Drop a load no plan carries (vLLM took fewer tokens, or asks again): its slots are
        free to go."""
        self.loading.pop(st.request.request_id, None)
        if st.load is not None:
            self.slots.done(st.load[2])
            st.load = None

    def _use(self, st: RequestPages, pages) -> None:
        """Count a use of the request's `pages` (indices); a page used again may be backed up
        now, from its host slot once its copy landed (`l3_writes.py`)."""
        again = self.l3_writes.used(st.hashes[p] for p in pages)
        if self.l3 and again:
            self.l3_writes.back_up(self.plan, again, tenant_digest(st.request.cache_salt), [st.request.request_id])

    def _done(self, job_id: int, pages: int) -> None:
        job, kind, _ = self.jobs.pop(job_id)
        self.l3_writes.done(job, kind, pages)
        if kind == "backup":
            self.slots.done(job_id)
            self.events.stored_hashes(job.hashes[:pages], "STORAGE")
            return
        put = self.slots.filled(job_id, job.slots, verified=pages, from_l3=True)
        self.counts["l3_prefetched_pages"] += len(put)
        for req_id in job.req_ids:
            st = self.requests.get(req_id)
            if st is not None:
                st.job = None
                self.events.stored_hashes(job.hashes[:pages], "STORAGE", st.request, st.hashes)
                self.events.stored_hashes(put, "CPU", st.request, st.hashes)
        self.events.removed(job.hashes[pages:pages + 1], "STORAGE")     # missing or damaged: not there

