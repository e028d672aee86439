"""Cache operations in flight, the FIFO ack queues that retire them, and retiring one."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..transfer.copier import CopyFailed
from ..transfer.events import CompletionEvent
from .radix import Node

if TYPE_CHECKING:
    from .op_tracing import OpTracer

# The tiers each kind of transfer moves pages between: (source, destination).
ROUTES = {"write": ("l1", "l2"), "load": ("l2", "l1"), "backup": ("l2", "l3"), "prefetch": ("l3", "l2")}


@dataclass(eq=False)
class CacheOp:
    """One batch transfer. `events[-1]` completing means the whole op is done."""

    kind: str
    node: Node | None
    events: list[CompletionEvent]
    pages: int
    nbytes: int
    hashes: list[str] = field(default_factory=list)      # page keys, for L3 follow-ups
    host_pages: list[int] = field(default_factory=list)
    span: Any = None
    started: float = field(default_factory=time.perf_counter)

    @property
    def done(self) -> CompletionEvent:
        return self.events[-1]

    @property
    def seconds(self) -> float:
        """From issue to completion (to now while it runs)."""
        return (getattr(self.done, "set_at", None) or time.perf_counter()) - self.started


@dataclass(eq=False)
class StorageOp(CacheOp):
    """A backup or prefetch running on a storage worker thread."""

    request_id: int = -1
    tokens: tuple[int, ...] = ()
    first_page: int = 0
    salt: str | None = None        # a prefetch's tenant: the tree its pages graft into
    wanted: bool = False           # the request reached the head of admission (best_effort)
    cancel: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    deadline: float = float("inf")

    @property
    def fetched_pages(self) -> int:
        """Pages this rank's prefetch brought in (its leading run); 0 if it failed."""
        return getattr(self.result, "pages", 0)


class AckQueue:
    """Ops of one kind in issue order; only a leading run of completed ops may retire."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._ops: deque[CacheOp] = deque()

    def __len__(self) -> int:
        return len(self._ops)

    def __iter__(self):
        return iter(self._ops)

    def head(self) -> CacheOp | None:
        return self._ops[0] if self._ops else None

    def push(self, op: CacheOp) -> None:
        self._ops.append(op)

    def ready(self) -> int:
        """Length of the leading run whose completion events query true."""
        n = 0
        for op in self._ops:
            if not op.done.query():
                break
            n += 1
        return n

    def retire(self, n: int) -> list[CacheOp]:
        if n > len(self._ops):
            raise AssertionError(f"{self.kind} queue: asked to retire {n} of {len(self._ops)} ops")
        return [self._ops.popleft() for _ in range(n)]


async def settle(op: CacheOp, step: int, tracer: OpTracer, timeout_s: float, attrs: dict | None = None) -> None:
    """Retire an op every rank agreed is done: a later pipeline stage may get there before its
    own copy finished, so await it (bounded); a failed copy stops the run, naming the op."""
    if not op.done.query():
        await op.done.wait(timeout_s, f"{tracer.coords.label()}: {op.kind} op at step {step}")
    if op.done.error is not None:
        raise CopyFailed(f"{tracer.coords.label()}: {op.kind} op of {op.pages} pages failed: {op.done.error}")
    tracer.retired(op, step, attrs)
