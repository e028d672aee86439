"""Every KV cache group of a model behind one connector, each group a tier of its own.

vLLM's hybrid KV cache manager gives each group (full attention, a sliding window, a Mamba or
linear-attention state) its own block table. Here each group has its own scheduler side (its
host slots, keyed by the same page hashes) and, on each worker, its own worker side (host
pool, copies, L3 store under the group's namespace), so a group's pages only ever hold its own layers' blocks. What the groups
share is the hit: a prefix is loaded only up to a boundary every group can serve, the full
groups from its start, a sliding window only the pages its layers still read there, a state
group only the state at that boundary (never attention KV without it, nor the reverse). A plain
model is one full-attention group: one side each, exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import JobReports, StepPlan
from .request_pages import RequestPages
from .scheduler import SchedulerSide
from .worker import WorkerSide


@dataclass
class GroupPlans:
    """A step's plan for each group, in vLLM's group order."""

    plans: list[StepPlan]


@dataclass
class GroupReports:
    """A worker's reports for each group; vLLM sums them across workers."""

    reports: list[JobReports | None]

    def aggregate(self, other: "GroupReports") -> "GroupReports":
        return GroupReports([b if a is None else a if b is None else a.aggregate(b)
                             for a, b in zip(self.reports, other.reports)])


class GroupedScheduler:
    """The scheduler sides of every group. Counts, events and a request's sources are the
    first full-attention group's: a page's tokens are the same in every group."""

    def __init__(self, sides: list[SchedulerSide]) -> None:
        self.sides = sides
        self.primary = next((s for s in sides if s.tables.window is None), sides[0])
        self.requests, self.counts, self.events = self.primary.requests, self.primary.counts, self.primary.events

    def matched(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The furthest boundary every group serves: each full group caps it at its run, each
        sliding window asked again below it until its window ends exactly there (a window
        ending elsewhere serves nothing)."""
        limit = None
        while True:
            for side in self.sides:
                side.requests.setdefault(request.request_id, RequestPages(request)).limit = limit
            hits = [side.matched(request, num_computed_tokens)[0] for side in self.sides]
            if None in hits:
                return None, False
            hit = min(hits)
            if all(h == hit for h, side in zip(hits, self.sides) if side.tables.window is not None):
                break
            limit = (num_computed_tokens + hit) // self.primary.page_size
        if not hit:
            for side in self.sides:
                side.allocated(request, 0)      # no load: what a side held is free to go
        return hit, False

    def allocated(self, request, num_external_tokens: int) -> None:
        for side in self.sides:
            side.allocated(request, num_external_tokens)

    def build(self, scheduled: dict[str, int], block_ids, preempted=(), offers=None) -> GroupPlans:
        """`block_ids(req_id)`: the request's block ids per group (vLLM's tuple). `offers`:
        vLLM's {request: [(group, block, boundary tokens)]} of state blocks this step completes
        (`boundary_state_offloads`); a state group saves those and nothing else. A boundary
        inside a page (a partial tail) is not one a page names: not saved."""
        for g, side in enumerate(self.sides):
            if side.tables.offered is not None:
                side.tables.offered = {r: {tokens // side.page_size - 1: block for group, block, tokens in entries
                                           if group == g and tokens % side.page_size == 0}
                                       for r, entries in (offers or {}).items()}
        return GroupPlans([side.build(scheduled, lambda r, g=g: block_ids(r)[g], preempted)
                           for g, side in enumerate(self.sides)])

    def finished(self, request) -> tuple[bool, dict]:
        """vLLM keeps every group's blocks while some group's saves are in flight; each
        group's workers then say when theirs landed (`GroupedWorker.finished_sending`)."""
        answers = [side.finished(request) for side in self.sides]
        keep = any(k for k, _ in answers)
        for side, (kept, _) in zip(self.sides, answers):
            if keep and not kept:
                side.keep.append(request.request_id)
        return keep, answers[self.sides.index(self.primary)][1]

    def reported(self, reports: GroupReports | None) -> None:
        for side, report in zip(self.sides, reports.reports if reports is not None else [None] * len(self.sides)):
            side.reported(report)

    def first_tokens(self) -> None:
        self.primary.first_tokens()

    def observed(self) -> dict:
        return self.primary.observed()

    def close(self) -> None:
        for side in self.sides:
            side.close()


class GroupedWorker:
    """This worker's side of every group; vLLM's layer names map to (group, layer within it)."""

    def __init__(self, sides: list[WorkerSide], layers: dict[str, tuple[int, int]],
                 early: frozenset[int] = frozenset()) -> None:
        self.sides, self.layers = sides, layers
        self.early = early      # state groups: their loads land before vLLM prepares the pass
        self._keep: dict[str, int] = {}     # finished requests: groups whose saves have not landed

    def begin(self, plans: GroupPlans) -> None:
        for side, plan in zip(self.sides, plans.plans):
            side.begin(plan)

    def start(self, plans: GroupPlans) -> None:
        for g, (side, plan) in enumerate(zip(self.sides, plans.plans)):
            if g not in self.early:
                side.start(plan)

    def wait_layer(self, name: str) -> None:
        where = self.layers.get(name)
        if where is not None:
            self.sides[where[0]].wait_layer(where[1])

    def finish(self, plans: GroupPlans) -> None:
        for side, plan in zip(self.sides, plans.plans):
            side.finish(plan)

    def preempted(self, plans: GroupPlans) -> None:
        """vLLM's first call of a step (`handle_preemptions`), before it prepares the pass: a
        state group's loads land here, since vLLM then copies a hit's state block into the
        request's running block (`preprocess_mamba`), before `start_load_kv`, and its Mamba
        and GDN layers never call `wait_for_layer_load`."""
        for g, (side, plan) in enumerate(zip(self.sides, plans.plans)):
            side.preempted(plan)
            if g in self.early:
                side.start(plan)
                side.copies.wait_loads()

    def finished_sending(self, plans: GroupPlans) -> set[str]:
        """Finished requests whose saves landed in every group."""
        for side, plan in zip(self.sides, plans.plans):
            for req_id in side.finished_sending(plan):
                self._keep[req_id] = self._keep.get(req_id, 0) + 1
        done = {r for r, n in self._keep.items() if n == len(self.sides)}
        for req_id in done:
            del self._keep[req_id]
        return done

    def load_errors(self) -> set[int]:
        return set().union(*(side.load_errors() for side in self.sides))

    def reports(self) -> GroupReports | None:
        reports = [side.reports() for side in self.sides]
        return GroupReports(reports) if any(r is not None for r in reports) else None

    def totals(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for side in self.sides:
            for name, n in side.totals().items():
                totals[name] = totals.get(name, 0) + n
        return totals

    def backup_queue(self) -> int:
        return sum(side.backup_queue() for side in self.sides)

    def close(self) -> None:
        for side in self.sides:
            side.close()
