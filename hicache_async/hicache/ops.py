"""Cache operations in flight, and the FIFO ack queue each kind retires through."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..events import CompletionEvent
from ..kinds import TransferKind
from .node import Node


@dataclass(eq=False)
class CacheOp:
    """One batch transfer. `events[-1]` completing means the whole op is done."""

    kind: TransferKind
    node: Node | None
    events: list[CompletionEvent]
    pages: int
    nbytes: int
    hashes: list[str] = field(default_factory=list)      # page keys, for L3 follow-ups
    host_pages: list[int] = field(default_factory=list)
    span: Any = None
    started: float = field(default_factory=time.perf_counter)
    due_us: float = 0.0        # a modelled clock's completion stamp, set as the op is issued

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
    deadline: float = float("inf")  # when its policy gives up on it, in the ledger clock's seconds
    committed: int = 0             # pages every rank fetched: what retiring it grafts
    terminated: bool = False       # retired before it finished: its policy gave up on it

    @property
    def fetched_pages(self) -> int:
        """Pages this rank's prefetch brought in (its leading run); 0 if it failed."""
        return getattr(self.result, "pages", 0)

    @property
    def late_calls(self) -> list:
        """This rank's calls of it given up on that may still write into its host pages."""
        return getattr(self.result, "late", [])


class AckQueue:
    """Ops of one kind in issue order; only a leading run of completed ops may retire."""

    def __init__(self, kind: TransferKind) -> None:
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

    def retire(self, n: int) -> list[CacheOp]:
        if n > len(self._ops):
            raise AssertionError(f"{self.kind} queue: asked to retire {n} of {len(self._ops)} ops")
        return [self._ops.popleft() for _ in range(n)]
