"""The step ledger: every op in flight, and what one step retires.

Tiers issue ops into it; once per step the plugin asks it what this rank could retire
(`offer`), agrees on the MIN with every other rank, and has it retire exactly that
(`retire`), FIFO per kind, so every rank's tree changes identically. It owns the ack queues,
the quarantine of host pages that calls given up on may still write into, the digest of
every cache decision (which the agreement compares across ranks) and the tracer hook, and
asks its clock, not the ops' events, when an op is due.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from ..clock import OpClock
from ..errors import CopyFailed
from ..events import CompletionEvent
from ..kinds import TransferKind
from ..parallel.agreement import NOT_READY
from ..storage.base import AbandonedCall
from .op_tracing import OpTracer
from .ops import AckQueue, CacheOp, StorageOp
from .quarantine import HELD_SLOTS, Quarantine

PREFETCH_SLOTS = 4          # leading prefetches one step can retire
WRITE, LOAD, BACKUP, PREFETCH = TransferKind


@dataclass(frozen=True)
class StepMessage:
    """What one rank could retire now; after the agreement, what every rank retires.

    It crosses ranks as `[writes, loads, backups, prefetches, prefetch_pages x PREFETCH_SLOTS,
    quiet x HELD_SLOTS, l3_kbps]`, every field combined with MIN: the count every rank can
    retire per queue, the pages every rank fetched per prefetch, whether every rank's calls
    into each held set of host pages have returned, and the slowest L3 throughput any rank
    just saw.
    """

    writes: int = 0
    loads: int = 0
    backups: int = 0
    prefetches: int = 0
    prefetch_pages: tuple[int, ...] = ()    # pages each of the leading `prefetches` fetched
    quiet: tuple[int, ...] = ()             # per held set of the quarantine's window: 1 when quiet,
                                            # padded to HELD_SLOTS with 0
    l3_kbps: int = NOT_READY

    L3 = slice(2, 4 + PREFETCH_SLOTS + HELD_SLOTS + 1)
    """The fields about L3 ops: every pipeline stage stores and fetches its own layers of a
    page, so these are agreed over the whole world while L3 work is under way."""

    def __post_init__(self) -> None:
        if len(self.prefetch_pages) != self.prefetches or self.prefetches > PREFETCH_SLOTS:
            raise ValueError(f"{self.prefetches} prefetches with pages {self.prefetch_pages}: "
                             f"expected one page count each, at most {PREFETCH_SLOTS}")
        if len(self.quiet) > HELD_SLOTS:
            raise ValueError(f"{len(self.quiet)} held sets offered: at most {HELD_SLOTS}")
        object.__setattr__(self, "quiet", (*self.quiet, *[0] * (HELD_SLOTS - len(self.quiet))))   # 0: keep

    def pack(self) -> list[int]:
        slots = [*self.prefetch_pages, *[NOT_READY] * (PREFETCH_SLOTS - self.prefetches)]
        return [self.writes, self.loads, self.backups, self.prefetches, *slots, *self.quiet, self.l3_kbps]

    @classmethod
    def unpack(cls, values: list[int]) -> StepMessage:
        """An agreed message; slots past the agreed prefetch count are dropped (some rank had
        no such prefetch, so their MIN means nothing)."""
        writes, loads, backups, prefetches = values[:4]
        quiet = tuple(values[4 + PREFETCH_SLOTS: 4 + PREFETCH_SLOTS + HELD_SLOTS])
        return cls(writes, loads, backups, prefetches, tuple(values[4: 4 + prefetches]), quiet, values[-1])


class Ledger:
    def __init__(self, tracer: OpTracer, clock: OpClock | None = None, timeout_s: float = 60.0) -> None:
        self.tracer, self.clock, self.timeout_s = tracer, clock or OpClock(), timeout_s
        self.queues = {kind: AckQueue(kind) for kind in TransferKind}
        self.quarantine = Quarantine()
        self.digest = 0
        self._l3_retired = False     # prefetches retired last step: their throughput is offered now

    def note(self, *decision: object) -> None:
        """Fold one cache decision into the running digest (62 bits, so -digest fits)."""
        h = hashlib.blake2b(repr((self.digest, decision)).encode(), digest_size=8).digest()
        self.digest = int.from_bytes(h, "little") >> 2

    def issue(self, op: CacheOp, request_ids: list[int] = ()) -> None:
        self.tracer.issue(op, list(request_ids))
        self.clock.issued(op)
        self.queues[op.kind].push(op)

    def hold(self, pages: list[int], late: list[AbandonedCall], release: Callable[[list[int]], None]) -> None:
        """Keep host pages from other KV until every rank agrees no call writes into them;
        `late`: this rank's calls given up on that still may."""
        if pages:
            self.note("hold", pages)
            self.quarantine.hold(pages, late, release)

    def busy(self, *kinds: TransferKind) -> bool:
        """Whether ops of these kinds (all kinds if none named) are in flight."""
        return any(len(self.queues[k]) for k in kinds or TransferKind)

    def l3_active(self) -> bool:
        """Whether this step's L3 fields must be agreed world-wide: L3 ops are in flight, or a
        prefetch retired last step, whose measured throughput every rank offers now, or host
        pages are held. All are the same on every rank, so every rank makes the same call."""
        return self._l3_retired or self.busy(BACKUP, PREFETCH) or len(self.quarantine) > 0

    # -- offer ------------------------------------------------------------------------------

    async def offer(self, step: int, gives_up: Callable[[StorageOp], bool], l3_kbps: int) -> StepMessage:
        """What this rank could retire now: the leading due ops of each queue, per leading
        prefetch the pages it fetched (0 for one its policy `gives_up` on), and which held
        host pages no call of this rank can still write into."""
        counts = [await self._leading(kind, step) for kind in (WRITE, LOAD, BACKUP)]
        pages: list[int] = []
        for op in self.queues[PREFETCH]:
            if len(pages) == PREFETCH_SLOTS:
                break
            if self.clock.due(op):
                if not op.done.query():
                    await self._landed(op, step)
                pages.append(op.fetched_pages)
            elif gives_up(op):
                pages.append(0)
            else:
                break
        return StepMessage(*counts, len(pages), tuple(pages), self.quarantine.offer(), l3_kbps)

    async def _leading(self, kind: TransferKind, step: int) -> int:
        n = 0
        for op in self.queues[kind]:
            if not self.clock.due(op):
                break
            if not op.done.query():
                await self._landed(op, step)
            n += 1
        return n

    async def _landed(self, op: CacheOp, step: int) -> None:
        """Await the bytes of an op a modelled clock calls due before they landed (bounded);
        under wall time a due op has landed, so the offer never suspends for it."""
        await op.done.wait(self.timeout_s, f"{self.tracer.coords.label()}: {op.kind} op due at step {step}")

    def ready_any(self) -> bool:
        """Whether some queue's head is due: an idle loop need not wait."""
        return any(self.clock.due(q.head()) for q in self.queues.values() if q.head() is not None)

    def heads(self) -> list[CompletionEvent]:
        """Completion events of the ops that retire next: what an idle loop may wait on."""
        return [q.head().done for q in self.queues.values() if q.head() is not None]

    # -- retire -----------------------------------------------------------------------------

    async def retire(self, agreed: StepMessage, step: int) -> dict[TransferKind, list[CacheOp]]:
        """Retire exactly what every rank agreed, FIFO per kind, and release the held host
        pages agreed quiet; returns the ops by kind.

        A later pipeline stage may get here before its own copy of an op finished: it awaits
        it (bounded). A prefetch retired before it was due was given up on by its policy:
        it is told to stop, and commits the pages every rank fetched."""
        released = self.quarantine.release(agreed.quiet)
        if released:
            self.note("release", released)
        retired = {WRITE: self.queues[WRITE].retire(agreed.writes), LOAD: self.queues[LOAD].retire(agreed.loads),
                   BACKUP: self.queues[BACKUP].retire(agreed.backups),
                   PREFETCH: self.queues[PREFETCH].retire(agreed.prefetches)}
        for op, pages in zip(retired[PREFETCH], agreed.prefetch_pages):
            if not self.clock.due(op):
                op.cancel.set()
                op.terminated = True
            op.nbytes = pages * (op.nbytes // max(op.pages, 1))
            op.committed = pages
        for kind, ops in retired.items():
            for op in ops:
                await self._settle(op, step)
            self.tracer.metrics.queue_depth(kind.value, len(self.queues[kind]))
        self._l3_retired = bool(retired[PREFETCH])
        return retired

    async def _settle(self, op: CacheOp, step: int) -> None:
        if not op.done.query():
            await op.done.wait(self.timeout_s, f"{self.tracer.coords.label()}: {op.kind} op at step {step}")
        if op.done.error is not None:
            raise CopyFailed(f"{self.tracer.coords.label()}: {op.kind} op of {op.pages} pages failed: {op.done.error}")
        attrs = {"hicache.pages_committed": op.committed} if op.kind is PREFETCH else None
        self.tracer.retired(op, step, attrs)

    def drain(self, kind: TransferKind) -> list[CacheOp]:
        """Take every op of `kind` out unretired (the plugin's exit), their spans cancelled."""
        ops = self.queues[kind].retire(len(self.queues[kind]))
        for op in ops:
            self.tracer.abandoned(op)
        return ops
