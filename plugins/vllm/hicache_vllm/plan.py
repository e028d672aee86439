"""What the scheduler tells every worker each step, and what the workers answer.

The scheduler decides; every worker (each TP rank, each PP stage) gets the same plan and moves
its own share of the bytes, so their host tiers hold the same pages in the same slots. What a
worker finishes later comes back as a report: a plan's copies (its loads and saves, which on a
GPU land on events steps later) by the plan's number, an L3 job (a prefetch, a backup) by the
job's. vLLM sums the workers' reports; a plan or job is done once every worker has reported it,
a job with the fewest pages any of them verified. Only then does a slot change state
(`host_slots.py`). Plain dataclasses: the connector names them as vLLM's types at its edge, so
the scheduler and worker sides run without vLLM (on a GPU machine that has none).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

NULL_BLOCK = 0      # vLLM's placeholder block (a sliding window's skipped pages): nothing moves to or from it


@dataclass
class Move:
    """Pages between vLLM blocks and host slots (a load, or a save), in page order; `pages`
    names what each slot holds, so a worker can refuse a load from a slot that holds another.
    A save's `table` is its request's blocks up to its last saved page, given only when the
    plan loads one of them: a page's KV is computed over every block before it, so a load that
    fails there spoils the saves from that block on."""

    req_id: str
    slots: list[int]
    blocks: list[int]
    pages: list[str]
    tenant: bytes = b""
    table: list[int] = field(default_factory=list)

    def keeping(self, keep: list[bool]) -> "Move":
        """The move of only the pages `keep` marks."""
        kept = [p for p, k in zip(zip(self.slots, self.blocks, self.pages), keep) if k]
        slots, blocks, pages = (list(column) for column in zip(*kept)) if kept else ([], [], [])
        return Move(self.req_id, slots, blocks, pages, self.tenant, self.table)

    def before(self, bad: set[int]) -> "Move":
        """The save without its pages at or after the first of `bad` blocks in its table."""
        first = next((i for i, b in enumerate(self.table) if b in bad), None)
        if first is None:
            return self
        position = {b: i for i, b in enumerate(self.table)}
        return self.keeping([position[b] < first for b in self.blocks])


@dataclass
class Job:
    """Work with L3: a backup stores host `slots` under `hashes`; a prefetch reads `hashes`
    into host `slots` (FILLING, in no page's use), verified, until the first that fails."""

    job: int
    hashes: list[str]
    tenant: bytes
    slots: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)    # vLLM's, for the job's span
    after_save: bool = False     # a backup of this plan's saves: each worker starts it once they landed


@dataclass
class StepPlan:
    """In the order a worker carries it out."""

    step: int = 0
    loads: list[Move] = field(default_factory=list)       # host -> blocks, beside the forward pass
    saves: list[Move] = field(default_factory=list)       # blocks -> host, after it
    backups: list[Job] = field(default_factory=list)      # host -> L3, in the background
    prefetches: list[Job] = field(default_factory=list)   # L3 -> host slots, in the background
    keep: list[str] = field(default_factory=list)         # finished requests whose blocks vLLM keeps till
                                                          # their saves landed (reported in get_finished)
    preempted: list[str] = field(default_factory=list)    # their blocks are reused: their saves must land first
    idle: bool = False                                    # no forward pass: only L3 is awaited
    fence: bool = False                                   # vLLM took back a block a save reads: land saves first
    unfilled: list[int] = field(default_factory=list)     # blocks vLLM counts loaded that no load fills
    tokens: int = 0                                       # vLLM computes these: the worker times its pass

    @property
    def copies(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class JobReports:
    """Per finished job: (workers that reported it, fewest pages verified or stored); per plan
    whose copies (loads and saves) landed: workers that reported it; and, per host slot, how
    many workers' abandoned reads may still write into it (`held`), or have since returned
    (`released`): the slot is free for reuse only when every hold is released; and pages
    whose objects a worker's store evicted (`evicted`): one worker's is enough, the page can
    no longer be read whole; and per plan, workers on which some of its saves failed or were
    dropped (`failed`): the plan's saved pages then hold on no worker's word. And what the
    scheduler's prefetch decision learns from (`prefetch_cost.py`), timed where the scheduler
    running a step ahead cannot skew it: each L3 read's (pages, seconds), and each forward
    pass's (tokens, seconds).
    """

    done: dict[int, tuple[int, int]] = field(default_factory=dict)
    copied: Counter = field(default_factory=Counter)
    held: Counter = field(default_factory=Counter)
    released: Counter = field(default_factory=Counter)
    synchronous: int = 0        # workers whose copies land before their step ends (CPU), said once
    evicted: set[str] = field(default_factory=set)
    failed: Counter = field(default_factory=Counter)
    reads: list[tuple[int, float]] = field(default_factory=list)
    passes: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: "JobReports") -> "JobReports":
        merged = dict(self.done)
        for job, (reports, pages) in other.done.items():
            seen, least = merged.get(job, (0, pages))
            merged[job] = (seen + reports, min(least, pages))
        return JobReports(merged, self.copied + other.copied, self.held + other.held, self.released + other.released,
                          self.synchronous + other.synchronous, self.evicted | other.evicted,
                          self.failed + other.failed, self.reads + other.reads, self.passes + other.passes)
