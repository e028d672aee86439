"""What the scheduler tells every worker each step, and what the workers answer.

The scheduler decides; every worker (each TP rank, each PP stage) gets the same plan and moves
its own share of the bytes, so their host tiers hold the same pages in the same slots. Work
a worker finishes later (an L3 prefetch, a backup) comes back as a report per job; vLLM sums
the workers' reports, and a job is done once every worker has reported it, with the fewest
pages any of them verified.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class Move:
    """Pages between vLLM blocks and host slots (a load, or a save), in page order."""

    req_id: str
    slots: list[int]
    blocks: list[int]

    def keeping(self, keep: list[bool]) -> "Move":
        """The move of only the pages `keep` marks."""
        pages = [(s, b) for s, b, k in zip(self.slots, self.blocks, keep) if k]
        return Move(self.req_id, [s for s, _ in pages], [b for _, b in pages])


@dataclass
class Job:
    """Work with L3: a backup stores host `slots` under `hashes`; a prefetch reads `hashes`
    into host `slots` (held for it, in no page's use), verified, until the first that fails."""

    job: int
    hashes: list[str]
    tenant: bytes
    slots: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)    # vLLM's, for the job's span
    slots_left: bool = False     # a backup's slots left the tier when it was issued (write_back)


@dataclass
class StepPlan(KVConnectorMetadata):
    """In the order a worker carries it out."""

    evictions: list[Job] = field(default_factory=list)    # host -> L3 before the slots are reused
    loads: list[Move] = field(default_factory=list)       # host -> blocks, before the forward pass
    saves: list[Move] = field(default_factory=list)       # blocks -> host, after it
    backups: list[Job] = field(default_factory=list)      # host -> L3, in the background
    prefetches: list[Job] = field(default_factory=list)   # L3 -> host slots, in the background
    idle: bool = False                                    # no forward pass: only L3 is awaited


@dataclass
class JobReports(KVConnectorWorkerMetadata):
    """Per finished job: (workers that reported it, fewest pages verified or stored); the host
    slots a worker left stale (their pages must not be loaded); and, per host slot, how many
    workers' abandoned reads may still write into it (`held`), or have since returned
    (`released`): the slot is free for reuse only when every hold is released."""

    done: dict[int, tuple[int, int]] = field(default_factory=dict)
    stale: set[int] = field(default_factory=set)
    held: Counter = field(default_factory=Counter)
    released: Counter = field(default_factory=Counter)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "JobReports":
        merged = dict(self.done)
        for job, (reports, pages) in other.done.items():
            seen, least = merged.get(job, (0, pages))
            merged[job] = (seen + reports, min(least, pages))
        return JobReports(merged, self.stale | other.stale, self.held + other.held, self.released + other.released)
