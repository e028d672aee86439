"""What a worker has yet to tell: its next report to the scheduler (`plan.JobReports`), and its
running counts for the stats. The step and the L3 threads both add to them, so what a thread
adds goes through a method, under one lock, and each report takes everything since the last
once."""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import structlog

from .plan import JobReports

log = structlog.get_logger(__name__)


class Acks:
    def __init__(self, synchronous: int) -> None:
        self._lock = threading.Lock()
        self.counts = {"host_loaded_pages": 0, "host_saved_pages": 0, "l3_stored_pages": 0, "l3_read_pages": 0,
                       "slot_violations": 0, "failed_saves": 0, "fenced_preemptions": 0}
        self._ended: dict[int, int] = {}                 # job -> pages, not yet reported
        self._held: Counter[int] = Counter()             # slots late reads may write: to report...
        self._released: Counter[int] = Counter()         # ...and those whose late reads returned
        self._reads: list[tuple[int, float]] = []        # timed L3 reads (pages, seconds), to report...
        self.passes: list[tuple[int, float]] = []        # ...and timed forward passes (tokens, seconds)
        self.copied: Counter[int] = Counter()            # plans whose copies landed, not yet reported
        self.failed: Counter[int] = Counter()            # ...of those, plans some of whose saves were dropped
        self.synchronous = synchronous                   # said in the first report

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                self.counts[name] += n

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def violation(self, what: str, slots: list[int], ok: list[bool]) -> None:
        """A slot rule broken (never, if the scheduler is right): the pages of the slots `ok`
        does not mark are dropped, logged and counted."""
        bad = [s for s, fine in zip(slots, ok) if not fine]
        log.error(f"hicache: slot rule broken ({what}); those pages are dropped", slots=bad)
        self.count(slot_violations=len(bad))

    def ended(self, job: int, pages: int) -> None:
        """An L3 job is over (done, failed or cancelled), `pages` of it stored or read."""
        with self._lock:
            self._ended[job] = pages

    def hold(self, slots: list[int]) -> None:
        """Slots an L3 read given up on may still write into..."""
        with self._lock:
            self._held.update(slots)

    def release(self, slots: list[int]) -> None:
        """...and those whose late reads all returned."""
        with self._lock:
            self._released.update(slots)

    def read(self, pages: int, seconds: float) -> None:
        """A timed L3 read, for the scheduler's cost model."""
        with self._lock:
            self._reads.append((pages, seconds))

    def take(self, evicted: Callable[[], set[str]]) -> JobReports | None:
        """Everything since the last report, then the pages the store evicted by now
        (`evicted`); None when there is nothing to say."""
        with self._lock:
            done, self._ended = self._ended, {}
            held, self._held = self._held, Counter()
            released, self._released = self._released, Counter()
            reads, self._reads = self._reads, []
        passes, self.passes = self.passes, []
        copied, self.copied = self.copied, Counter()
        failed, self.failed = self.failed, Counter()
        synchronous, self.synchronous = self.synchronous, 0
        gone = evicted()
        if not (done or copied or held or released or synchronous or gone or reads or passes):
            return None
        return JobReports({job: (1, pages) for job, pages in done.items()}, copied, held, released, synchronous,
                          gone, failed, reads, passes)
