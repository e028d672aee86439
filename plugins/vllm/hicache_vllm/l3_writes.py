"""Which host pages are written to L3, and when (`write_policy`), against what the scheduler
knows L3 holds.

write_through backs up every page a save puts in the host tier, write_through_selective a page
on its second use (computed, or reused from vLLM's device cache or our host tier), each from
its host slot once its copy landed; write_back a page only as it leaves the host tier. Never a
page L3 is known to hold, nor one a backup is storing already; a backup's slots are read by it
(never reused) till every worker reported it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from .host_slots import HostSlots
from .plan import Job, StepPlan
from .settings import Settings

KNOWN_PAGES = 1 << 20   # pages the scheduler remembers as stored in L3, and the uses of


class L3Writes:
    def __init__(self, settings: Settings, slots: HostSlots, job: Callable[..., Job]) -> None:
        """`job(plan_list, kind, hashes, tenant, slots, req_ids)`: the scheduler's, a job for the workers."""
        self.settings, self.slots, self._job = settings, slots, job
        self.stored: OrderedDict[str, None] = OrderedDict()   # pages known to be in L3, the latest
        self.storing: set[str] = set()                        # pages of unfinished backups
        self.uses: OrderedDict[str, int] = OrderedDict()      # uses per page (selective write-through)

    def leaves_through_l3(self, page: str) -> bool:
        """Whether `page` reaches L3 before its host slot is reused (write_back)."""
        return self.settings.write_policy == "write_back" and page not in self.stored

    def leaving(self, plan: StepPlan, leaving: list[tuple[str, int, bytes]]) -> None:
        """Back up the (page, slot, tenant) that leave the host tier through L3, one backup a
        tenant, in `plan`; each reads its slots from now."""
        for tenant in dict.fromkeys(t for _, _, t in leaving):
            mine = [(h, s) for h, s, t in leaving if t == tenant]
            job = self._job(plan.backups, "backup", [h for h, _ in mine], tenant, [s for _, s in mine])
            self.slots.read(job.job, job.slots)
            self.storing.update(job.hashes)

    def saved(self, plan: StepPlan, pages: list[str], slots: list[int], tenant: bytes, req_ids: list[str]) -> None:
        """`pages` that `plan` saves into `slots`: those the policy backs up now, in this plan
        (so it is delivered even if no step follows), each worker once its save landed."""
        worthy = [(h, slot) for h, slot in zip(pages, slots) if self._worth_backing_up(h)]
        if worthy:
            self.back_up(plan, [h for h, _ in worthy], tenant, req_ids, after_save=[s for _, s in worthy])

    def used(self, pages: Iterable[str]) -> list[str]:
        """Count a use of `pages`: computed, or reused from vLLM's device cache or our host
        tier. Under write_through_selective, those now used a second time, to back up."""
        if self.settings.write_policy != "write_through_selective":
            return []
        again = []
        for h in pages:
            self.uses[h] = self.uses.pop(h, 0) + 1
            if self.uses[h] >= 2:
                again.append(h)
        _forget_oldest(self.uses)
        return again

    def back_up(self, plan: StepPlan, pages: list[str], tenant: bytes, req_ids: list[str] = (),
                after_save: list[int] | None = None) -> None:
        """Back up `pages` that L3 is not known to hold and no backup is storing already: HOLDING
        ones, or (`after_save`, their slots) ones this plan saves, which each worker backs up
        once its save landed. Their slots are read by the backup (never reused) till every
        worker reported it."""
        slot_of = dict(zip(pages, after_save)) if after_save is not None else {}
        todo = [h for h in dict.fromkeys(pages) if h not in self.stored and h not in self.storing
                and (h in slot_of or self.slots.holding(h))]
        if not todo:
            return
        slots = [slot_of.get(h, self.slots.slot_of[h]) for h in todo]
        job = self._job(plan.backups, "backup", todo, tenant, slots, req_ids=req_ids)
        job.after_save = after_save is not None
        self.slots.read(job.job, slots, after_fill=job.after_save)
        self.storing.update(todo)

    def done(self, job: Job, kind: str, pages: int) -> None:
        """A job every worker reported, its first `pages` stored or read, verified: in L3; the
        rest (missing, or failed verification and removed) are stored again."""
        self.stored.update(dict.fromkeys(job.hashes[:pages]))
        for h in job.hashes[pages:]:
            self.stored.pop(h, None)
        _forget_oldest(self.stored)
        if kind == "backup":
            self.storing.difference_update(job.hashes)

    def evicted(self, pages) -> None:
        """Pages a worker's store evicted: no longer in L3."""
        for page in pages:
            self.stored.pop(page, None)

    def _worth_backing_up(self, page: str) -> bool:
        policy = self.settings.write_policy
        return policy == "write_through" or (policy == "write_through_selective" and self.uses.get(page, 0) >= 2)


def _forget_oldest(known: OrderedDict) -> None:
    """Keep what the scheduler remembers of pages bounded: a page forgotten costs at most a
    backup that finds its object already stored, or a second use counted as a first."""
    while len(known) > KNOWN_PAGES:
        known.popitem(last=False)
