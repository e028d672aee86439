"""The scheduler side: decides, per request and per step, what the workers move.

A prompt's pages are named by our chained page hash over its token ids and everything else
that decides their KV (`request_keys.py`), so a new process, or another engine over the same
L3, names them alike, and a request with another adapter or other embeddings names them apart. A request whose prefix
runs on past vLLM's own cache and our host tier waits one step while the workers read the
rest from L3 straight into host slots held for it, each object verified; the hit vLLM then loads is only what every
worker verified, so a missing, corrupt, forged or stale object shortens the hit and never
becomes KV; a read that outlasts `storage_timeout` is not waited for (the prefix is
recomputed). Host-tier hits load synchronously, layer by layer, beside the forward pass.
A slot a backup reads stays pinned until every worker reported the backup, so a save never
waits for L3; a page is not backed up twice at once.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from hicache_async.keys import tenant_digest

from .host_index import HostIndex
from .plan import Job, JobReports, Move, StepPlan
from .request_keys import RequestKeys, reads_external
from .settings import Settings
from .tier_events import TierEvents

KNOWN_PAGES = 1 << 20   # pages the scheduler remembers as stored in L3, and the uses of


@dataclass
class RequestPages:
    """One request's pages as the scheduler tracks them."""

    request: object                      # vLLM's Request, live
    hashes: list[str] = field(default_factory=list)
    keyed: bool = True                   # False: something decides its KV that we cannot name
    looked_in_l3: bool = False
    job: int | None = None               # the prefetch it waits for
    load: tuple[int, list[int]] | None = None   # (first page, slots) to load
    saved: int = 0                       # leading pages already in the host tier or planned
    from_host: int = 0                   # tokens it took from the host tier...
    from_l3: int = 0                     # ...and of those, from L3 through it


class SchedulerSide:
    def __init__(self, settings: Settings, page_size: int, workers: int, model_id: str = "") -> None:
        self.settings, self.page_size, self.workers, self.model_id = settings, page_size, workers, model_id
        self.index = HostIndex(settings.host_pages)
        self.keys = RequestKeys(page_size)
        self.l3 = settings.storage != "none"
        self.requests: dict[str, RequestPages] = {}
        self.loading: dict[str, RequestPages] = {}      # allocated loads no plan has carried yet
        self.jobs: dict[int, tuple[Job, str, float]] = {}   # unfinished, with their kind and start
        self.backing_up: set[str] = set()               # pages of unfinished backups
        self.held: Counter[int] = Counter()             # slots abandoned reads may still write, by workers
        self.spare: set[int] = set()                    # held slots no page uses: free once released
        self.reports = JobReports()                     # of jobs not every worker has reported yet
        self.stored_l3: OrderedDict[str, None] = OrderedDict()   # pages known to be in L3, the latest
        self.uses: OrderedDict[str, int] = OrderedDict()         # uses per page (selective write-through)
        self.plan = StepPlan()
        self.events = TierEvents(page_size, settings.host_pages, KNOWN_PAGES)
        self.counts = {"host_hit_tokens": 0, "l3_hit_tokens": 0, "l3_prefetched_pages": 0, "l3_looked_pages": 0}
        self._ids = itertools.count()

    # -- vLLM's questions ----------------------------------------------------------------

    def matched(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self.requests.get(request.request_id)
        if st is None:
            st = self.requests[request.request_id] = RequestPages(request)
            self._extend(st)
            self._use(st, range(min(num_computed_tokens // self.page_size, len(st.hashes))))  # device hits
        if st.job is not None:
            if not self._overdue(st.job):
                return None, False          # its L3 read is still under way
            st.job = None                   # not worth waiting for: recompute
        if not st.keyed or not reads_external(request):
            st.looked_in_l3 = True
            return 0, False
        stop = min(len(st.hashes), (request.num_prompt_tokens - 1) // self.page_size)
        start = num_computed_tokens // self.page_size
        run = self.index.run(st.hashes, start, stop) if start < stop else 0
        missing = stop - start - run
        if self.l3 and not st.looked_in_l3 and missing >= self.settings.prefetch_min_pages:
            st.looked_in_l3 = True
            if self._prefetch(st, st.hashes[start + run:stop]):
                return None, False
        st.looked_in_l3 = True
        st.load = (start, self.index.slots(st.hashes[start:start + run])) if run else None
        return run * self.page_size, False

    def allocated(self, request, num_external_tokens: int) -> None:
        st = self.requests.get(request.request_id)
        if st is None or not num_external_tokens or st.load is None:
            return
        first, slots = st.load
        slots = slots[:num_external_tokens // self.page_size]
        st.load = (first, slots)
        self.loading[request.request_id] = st   # vLLM counts these tokens computed: the load must happen
        self.index.pin(slots)       # till a plan carries the load
        pages = st.hashes[first:first + len(slots)]
        from_l3 = sum(1 for h in pages if h in self.index.from_l3)
        st.from_host += len(slots) * self.page_size
        st.from_l3 += from_l3 * self.page_size
        self.counts["host_hit_tokens"] += len(slots) * self.page_size
        self.counts["l3_hit_tokens"] += from_l3 * self.page_size
        self.index.from_l3.difference_update(pages)    # used once: a later use is a host hit
        self._use(st, range(first, first + len(slots)))

    def build(self, scheduled: dict[str, int], block_ids) -> StepPlan:
        """This step's plan: what was decided since the last one (prefetches, evictions), the
        loads decided at allocation, and the saves of every page this step completes."""
        plan, self.plan = self.plan, StepPlan()
        for req_id in [r for r in self.loading if r in scheduled]:
            st = self.loading.pop(req_id)
            first, slots = st.load
            plan.loads.append(Move(req_id, slots, block_ids(req_id)[first:first + len(slots)]))
            self.index.pin(slots, -1)       # workers load before this plan's saves reuse a slot
            st.load = None
        for req_id, n in scheduled.items():
            st = self.requests.get(req_id)
            if st is not None:
                self._save(plan, st, st.request.num_computed_tokens + n, block_ids)
        plan.idle = not scheduled
        return plan

    def finished(self, request) -> dict:
        """What the request's `kv_transfer_params` say of where its prefix came from."""
        st = self.requests.pop(request.request_id, None)
        if st is None:
            return {}
        if self.loading.pop(request.request_id, None) is not None:
            self.index.pin(st.load[1], -1)
        return {"hicache": {"host_tokens": st.from_host - st.from_l3, "l3_tokens": st.from_l3,
                            "model": self.model_id}}

    def reported(self, reports: JobReports | None) -> None:
        """Fold the workers' job reports in; a job every worker reported is done. Pages in
        slots a worker left stale are forgotten: no load may read them."""
        if reports is None:
            return
        self.events.removed(self.index.forget_slots(reports.stale), "CPU")
        self.held.update(reports.held)
        self.held.subtract(reports.released)
        free = [s for s in self.spare if self.held[s] <= 0]
        self.spare.difference_update(free)
        self.index.give_back(free)
        self.held = +self.held
        self.reports = self.reports.aggregate(JobReports(reports.done))
        for job in [job for job, (seen, _) in self.reports.done.items() if seen >= self.workers]:
            self._done(job, self.reports.done.pop(job)[1])

    # -- plans -----------------------------------------------------------------------------

    def _job(self, plan_list: list[Job], kind: str, hashes: list[str], tenant: bytes, slots: list[int] = (),
             req_ids: list[str] = ()) -> Job:
        """A job for the workers; a prefetch's requests wait for it."""
        job = Job(next(self._ids), hashes, tenant, list(slots), list(req_ids))
        self.jobs[job.job] = (job, kind, time.monotonic())
        plan_list.append(job)
        return job

    def _prefetch(self, st: RequestPages, hashes: list[str]) -> bool:
        """Read `hashes` from L3 into host slots taken (and pinned) for it now; False when no
        slot is free."""
        slots = self._take(self.plan, len(hashes))
        if not slots:
            return False
        self.index.pin(slots)
        hashes = hashes[:len(slots)]
        st.job = self._job(self.plan.prefetches, "prefetch", hashes, tenant_digest(st.request.cache_salt),
                           slots, req_ids=[st.request.request_id]).job
        self.counts["l3_looked_pages"] += len(hashes)
        return True

    def _overdue(self, job_id: int) -> bool:
        """A prefetch not every worker reported within `storage_timeout`: a hung call, or a
        worker that never answers, costs a recompute, not a request parked for ever."""
        job = self.jobs.get(job_id)
        return job is None or time.monotonic() - job[2] > self.settings.storage_timeout

    def _backup(self, plan_list: list[Job], pages: list[tuple[str, int, bytes]], req_ids: list[str] = (),
                pinned: bool = True) -> None:
        """Back up (hash, slot, tenant) pages that L3 is not known to hold and no backup is
        storing already, one job a tenant. Their slots stay pinned (never reused) till every
        worker reported the job, unless they already left the tier (`pinned` False)."""
        todo = [p for p in dict((p[0], p) for p in pages).values()
                if p[0] not in self.stored_l3 and p[0] not in self.backing_up]
        for tenant in dict.fromkeys(t for _, _, t in todo):
            mine = [(h, s) for h, s, t in todo if t == tenant]
            job = self._job(plan_list, "backup", [h for h, _ in mine], tenant, [s for _, s in mine], req_ids=req_ids)
            self.backing_up.update(job.hashes)
            if pinned:
                self.index.pin(job.slots)
            else:
                job.slots_left = True

    def _take(self, plan: StepPlan, n: int) -> list[int]:
        """`n` host slots at most; under write_back, the pages that leave go to L3 first."""
        slots, evicted = self.index.take(n)
        self.events.removed([h for h, _, _ in evicted], "CPU")
        if self.l3 and evicted and self.settings.write_policy == "write_back":
            self._backup(plan.evictions, evicted, pinned=False)
        return slots

    def _save(self, plan: StepPlan, st: RequestPages, computed: int, block_ids) -> None:
        """Host slots for the request's pages that this step completes, not yet in the tier."""
        self._extend(st)
        if not st.keyed:
            return
        full = min(computed // self.page_size, len(st.hashes))
        todo = [p for p in range(st.saved, full) if st.hashes[p] not in self.index.slot_of]
        st.saved = max(st.saved, full)
        if not todo:
            return
        slots = self._take(plan, len(todo))
        if not slots:
            return      # every slot is held by a load still to come: these pages skip the tier
        todo = todo[:len(slots)]
        blocks = block_ids(st.request.request_id)
        plan.saves.append(Move(st.request.request_id, slots, [blocks[p] for p in todo]))
        tenant = tenant_digest(st.request.cache_salt)
        pages = [(st.hashes[p], s, tenant) for p, s in zip(todo, slots)]
        for h, s, t in pages:
            self.index.put(h, s, t)
        self.events.stored(st.request, todo, st.hashes, "CPU")
        if self.l3 and self.settings.write_policy == "write_through":
            self._backup(plan.backups, pages, [st.request.request_id])
        self._use(st, todo)

    def _extend(self, st: RequestPages) -> None:
        """Hashes for every full page of the request's tokens so far."""
        st.keyed = st.keyed and self.keys.extend(st.request, st.hashes)

    def _use(self, st: RequestPages, pages) -> None:
        """Count a use of the request's `pages` (indices): computed, or reused from vLLM's
        device cache or our host tier. write_through_selective backs a page up on its second
        use, from its host slot, if it still has one."""
        if self.settings.write_policy != "write_through_selective":
            return
        again = []
        for h in (st.hashes[p] for p in pages):
            self.uses[h] = self.uses.pop(h, 0) + 1
            if self.uses[h] >= 2 and h in self.index.slot_of:
                again.append(h)
        _forget_oldest(self.uses)
        if self.l3 and again:
            tenant = tenant_digest(st.request.cache_salt)
            self._backup(self.plan.backups, [(h, self.index.slot_of[h], tenant) for h in again],
                         [st.request.request_id])

    def _done(self, job_id: int, pages: int) -> None:
        job, kind, _ = self.jobs.pop(job_id)
        self.stored_l3.update(dict.fromkeys(job.hashes[:pages]))
        for h in job.hashes[pages:]:    # missing or failed verification (and removed): store it again
            self.stored_l3.pop(h, None)
        _forget_oldest(self.stored_l3)
        if kind == "backup":
            self.backing_up.difference_update(job.hashes)
            if not job.slots_left:
                self.index.pin(job.slots, -1)
            self.events.stored_hashes(job.hashes[:pages], "STORAGE")
            return
        self.index.pin(job.slots, -1)
        spare, put = [], []
        for i, (h, slot) in enumerate(zip(job.hashes, job.slots)):
            if i < pages and h not in self.index.slot_of:
                self.index.put(h, slot, job.tenant, from_l3=True)
                put.append(h)
            else:
                spare.append(slot)
        self.counts["l3_prefetched_pages"] += len(put)
        self.index.give_back([s for s in spare if self.held[s] <= 0])
        self.spare.update(s for s in spare if self.held[s] > 0)
        for req_id in job.req_ids:
            st = self.requests.get(req_id)
            if st is not None:
                st.job = None
                self.events.stored_hashes(job.hashes[:pages], "STORAGE", st.request, st.hashes)
                self.events.stored_hashes(put, "CPU", st.request, st.hashes)
        self.events.removed(job.hashes[pages:pages + 1], "STORAGE")     # missing or damaged: not there


def _forget_oldest(known: OrderedDict) -> None:
    """Keep what the scheduler remembers of pages bounded: a page forgotten costs at most a
    backup that finds its object already stored, or a second use counted as a first."""
    while len(known) > KNOWN_PAGES:
        known.popitem(last=False)
