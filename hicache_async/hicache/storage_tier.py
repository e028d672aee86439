"""L3: backups (L2 -> L3) after write acks, and prefetches (L3 -> L2) on admission.

Each op is a task in the plugin's task group, so none outlives the plugin. Its storage calls
run on worker threads (`anyio.to_thread`) so the event loop never waits on I/O, under a
capacity limiter per kind, so a burst of backups never delays a prefetch a request waits
on. An op moves SLICE_PAGES at a time and queues for its limiter again after each slice,
behind whatever queued meanwhile (the limiter is FIFO), so a long op shares the workers
with short ones instead of holding them up. Completion is signalled on the op's event.
Both kinds go into the step ledger and retire through the per-step agreement, like L1/L2
ops: a prefetch commits only the pages that every rank fetched (MIN), so trees stay
identical. The tier works on the tree and the host pool itself; it asks the cache only for
host room, which may evict.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import anyio
from anyio.abc import TaskGroup
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN

from ..config import CacheConfig
from ..errors import HiCacheError
from ..events import HostEvent
from ..keys import tenant_digest
from ..kinds import TransferKind
from ..transfer.page_store import PageStore
from .cache import TieredCache
from .node import Node
from .ops import CacheOp, StorageOp

log = logging.getLogger(__name__)
SLICE_PAGES = 64   # pages a worker moves before the op queues again


class StorageTier:
    def __init__(self, cache: TieredCache, store: PageStore, config: CacheConfig,
                 tasks: TaskGroup | None = None) -> None:
        self.cache, self.store, self.config = cache, store, config
        self.tree, self.host, self.ledger = cache.tree, cache.host, cache.ledger
        self.tasks = tasks      # the owner's task group, once it is entered
        self._workers = {kind: anyio.CapacityLimiter(config.storage_workers)
                         for kind in (TransferKind.BACKUP, TransferKind.PREFETCH)}
        self.errors = 0
        self.terminated = 0     # prefetches the policy ended before they finished
        self.earlier_pages = 0  # pages fetched that this run never cached: L3 held them from before it

    # -- issue ------------------------------------------------------------------------------

    def back_up(self, writes: list[CacheOp]) -> None:
        """Copy retired writes' host pages to storage; the host pages stay locked till then."""
        page_bytes = self.host.layout.page_bytes
        for write in writes:
            op = StorageOp(TransferKind.BACKUP, write.node, [HostEvent()], write.pages, write.pages * page_bytes,
                           hashes=write.hashes, host_pages=write.host_pages)
            self.tree.lock_host(write.node)
            self.ledger.note("backup", write.node.id, write.pages)
            self._start(op, functools.partial(self.store.backup, tenant=tenant_digest(write.node.salt)),
                        op.hashes, op.host_pages)

    def prefetch(self, request_id: int, parent: Node | None, tokens: list[int], first_page: int,
                 hashes: list[str], salt: str | None = None) -> StorageOp | None:
        """Fetch pages `first_page..` of `tokens` (tenant `salt`'s) into fresh host pages; None
        if no room."""
        n = len(hashes) - first_page
        pages = self.cache.alloc_host(n, keep=parent)   # room, but not by evicting the graft point
        if pages is None:
            return None
        self.tree.pin(parent)
        self.ledger.note("prefetch", request_id, first_page, n)
        op = StorageOp(TransferKind.PREFETCH, parent, [HostEvent()], n, n * self.host.layout.page_bytes,
                       request_id=request_id, hashes=hashes, host_pages=pages, tokens=tuple(tokens),
                       first_page=first_page, salt=salt, deadline=self.ledger.clock.now() + self._patience(n))
        self._start(op, functools.partial(self.store.prefetch, cancel=op.cancel, tenant=tenant_digest(salt)),
                    hashes[first_page:], pages, [request_id])
        return op

    def _start(self, op: StorageOp, call, hashes: list[str], host_pages: list[int],
               request_ids: list[int] = ()) -> None:
        if self.tasks is None:
            raise HiCacheError("storage ops run in the plugin's task group: use the plugin as "
                               "`async with plugin:` around the scheduler loop")
        self.ledger.issue(op, request_ids)
        self.tasks.start_soon(self._run, op, call, hashes, host_pages, name=f"hicache {op.kind}")

    async def _run(self, op: StorageOp, call, hashes: list[str], host_pages: list[int]) -> None:
        """Move the op's pages slice by slice, queueing for a worker before each; its event
        completes whatever happens, cancellation included."""
        try:
            for start in range(0, len(hashes), SLICE_PAGES):
                if await anyio.to_thread.run_sync(self._move, op, call, hashes, host_pages, start,
                                                  limiter=self._workers[op.kind]):
                    break
        finally:
            if not op.done.query():     # cancelled before its last slice ran
                op.done.set()

    def _move(self, op: StorageOp, call, hashes: list[str], host_pages: list[int], start: int) -> bool:
        """One slice, on a worker thread (its storage spans nest under the op's); results add
        up slice by slice. True once the op is complete: the last slice, a prefetch slice that
        did not fetch every page (the leading run ended), a cancelled op or a failed call. The
        event is set here, so the next step sees it without waiting for the loop."""
        stop = min(start + SLICE_PAGES, len(hashes))
        try:
            with trace.use_span(op.span or INVALID_SPAN, end_on_exit=False):
                part = call(hashes[start:stop], self.host, host_pages[start:stop])
            op.result = part if start == 0 else _sum(op.result, part)
            whole = getattr(part, "pages", stop - start) == stop - start
            complete = stop == len(hashes) or not whole or op.cancel.is_set()
        except Exception as exc:   # noqa: BLE001 - the op's outcome, counted when it retires
            op.result, complete = exc, True
        if complete:
            op.done.set()
        return complete

    def _patience(self, pages: int) -> float:
        """Seconds a prefetch may run before it is terminated: the timeout policy's budget, and
        for the other policies the cap, so a hung backend never stalls a request for good."""
        cfg = self.config
        if cfg.prefetch_policy == "timeout":
            return cfg.prefetch_timeout(pages * cfg.page_size)
        return cfg.prefetch_timeout_max_s

    # -- this rank's view for the agreement ---------------------------------------------------

    def gives_up(self, op: StorageOp) -> bool:
        """Whether the prefetch policy stops waiting for an unfinished prefetch now: best_effort
        once its request is wanted, every policy at its deadline."""
        return (self.config.prefetch_policy == "best_effort" and op.wanted) or self.ledger.clock.now() > op.deadline

    def next_deadline(self) -> float:
        """When the head prefetch's policy gives up on it (clock seconds; inf if none)."""
        head = self.ledger.queues[TransferKind.PREFETCH].head()
        return head.deadline if head is not None else float("inf")

    # -- retired ----------------------------------------------------------------------------

    def retired(self, backups: list[StorageOp], prefetches: list[StorageOp]) -> None:
        """Ops every rank retired: backups give back their host lock, prefetches commit."""
        history = self.cache.history
        for op in backups:
            self.tree.lock_host(op.node, -1)
            if history is not None:
                history.backed_up(op.hashes)
            self._count_errors(op)
        for op in prefetches:
            self.terminated += op.terminated
            self._commit(op)

    def _commit(self, op: StorageOp) -> None:
        """Graft the pages every rank fetched under the prefix and hold the rest in the
        ledger's quarantine. The op's task has ended (settled), but a call of it given up on
        may still write into its pages; they go back to the pool once every rank agrees none
        can, at the same step on every rank."""
        self.tree.pin(op.node, -1)
        self.ledger.note("prefetch-done", op.request_id, op.committed)
        unused = op.host_pages[op.committed:]
        if op.committed:
            unused += self.tree.graft_host(list(op.tokens), op.first_page, op.hashes, op.host_pages[:op.committed],
                                           op.salt)
            if self.cache.history is not None:
                fetched = op.hashes[op.first_page: op.first_page + op.committed]
                self.earlier_pages += self.cache.history.backed_up(fetched)
        self.ledger.hold(unused, op.late_calls, self.host.alloc.release)
        self._count_errors(op)

    def _count_errors(self, op: StorageOp) -> None:
        failed = 1 if isinstance(op.result, Exception) else getattr(op.result, "errors", 0)
        if failed:
            self.errors += failed
            cause = op.result if isinstance(op.result, Exception) else "failed objects"
            log.warning("storage %s of %d pages had %d failures (%s); the cache carries on "
                        "without those pages", op.kind, op.pages, failed, cause)

    # -- the owner's exit -------------------------------------------------------------------

    def stop(self) -> None:
        """Tell running prefetches to stop at their next object: nobody will wait for them."""
        for op in self.ledger.queues[TransferKind.PREFETCH]:
            op.cancel.set()

    def abandon(self) -> None:
        """Once no task runs: give back what unretired ops hold (a cancelled prefetch its host
        pages, a backup its host lock) and the held pages no late call can write into, so the
        cache is whole again but for pages a call given up on may still write."""
        for op in self.ledger.drain(TransferKind.BACKUP):
            self.tree.lock_host(op.node, -1)
        for op in self.ledger.drain(TransferKind.PREFETCH):
            self.tree.pin(op.node, -1)
            self.ledger.hold(op.host_pages, op.late_calls, self.host.alloc.release)
        kept = self.ledger.quarantine.close()
        if kept:
            log.warning("%d host pages stay out of the pool: storage calls given up on may still write "
                        "into them", kept)


def _sum(a, b):
    """Two slices' results of one op as one: counts add up, per-page lists concatenate."""
    return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)})
