"""L3: backups (L2 -> L3) after write acks, and prefetches (L3 -> L2) on admission.

Each op is a task in the plugin's task group, so none outlives the plugin. Its storage calls
run on worker threads (`anyio.to_thread`) so the event loop never waits on I/O, under a
capacity limiter per kind, so a burst of backups never delays a prefetch a request waits
on. An op moves SLICE_PAGES at a time and queues for its limiter again after each slice,
behind whatever queued meanwhile (the limiter is FIFO), so a long op shares the workers
with short ones instead of holding them up. Completion is signalled on the op's event,
which `on_step` polls. Both kinds retire through ack queues and the per-step agreement,
like L1/L2 ops: a prefetch commits only the pages that every rank fetched (MIN), so trees
stay identical.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time

import anyio
from anyio.abc import TaskGroup
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN

from ..config import CacheConfig
from ..errors import HiCacheError
from ..parallel.agreement import PREFETCH_SLOTS
from ..transfer.events import CompletionEvent, HostEvent
from ..transfer.page_store import PageStore
from .cache import TieredCache
from .ops import AckQueue, CacheOp, StorageOp, settle
from .radix import Node

log = logging.getLogger(__name__)
SLICE_PAGES = 64   # pages a worker moves before the op queues again


class StorageTier:
    def __init__(self, cache: TieredCache, store: PageStore, config: CacheConfig,
                 tasks: TaskGroup | None = None) -> None:
        self.cache, self.store, self.config, self.tracer = cache, store, config, cache.tracer
        self.tasks = tasks      # the owner's task group, once it is entered
        self.backups = AckQueue("backup")
        self.prefetches = AckQueue("prefetch")
        self._workers = {kind: anyio.CapacityLimiter(config.storage_workers) for kind in ("backup", "prefetch")}
        self.errors = 0
        self.terminated = 0     # prefetches the policy ended before they finished

    # -- issue ------------------------------------------------------------------------------

    def back_up(self, writes: list[CacheOp]) -> None:
        """Copy retired writes' host pages to storage; the host pages stay locked till then."""
        page_bytes = self.cache.host.layout.page_bytes
        for write in writes:
            op = StorageOp("backup", write.node, [HostEvent()], write.pages, write.pages * page_bytes,
                           hashes=write.hashes, host_pages=write.host_pages)
            self.cache.lock_host(write.node)
            self.cache.note("backup", write.node.id, write.pages)
            self._start(op, self.store.backup, op.hashes, op.host_pages, self.backups)

    def prefetch(self, request_id: int, parent: Node | None, tokens: list[int], first_page: int,
                 hashes: list[str], salt: str | None = None) -> StorageOp | None:
        """Fetch pages `first_page..` of `tokens` (tenant `salt`'s) into fresh host pages; None
        if no room."""
        n = len(hashes) - first_page
        pages = self.cache.alloc_host(n, keep=parent)   # room, but not by evicting the graft point
        if pages is None:
            return None
        self.cache.pin(parent)
        self.cache.note("prefetch", request_id, first_page, n)
        op = StorageOp("prefetch", parent, [HostEvent()], n, n * self.cache.host.layout.page_bytes,
                       request_id=request_id, hashes=hashes, host_pages=pages, tokens=tuple(tokens),
                       first_page=first_page, salt=salt, deadline=time.monotonic() + self._patience(n))
        self._start(op, functools.partial(self.store.prefetch, cancel=op.cancel), hashes[first_page:],
                    pages, self.prefetches, (request_id,))
        return op

    def _start(self, op: StorageOp, call, hashes: list[str], host_pages: list[int], queue: AckQueue,
               request_ids: tuple[int, ...] = ()) -> None:
        if self.tasks is None:
            raise HiCacheError("storage ops run in the plugin's task group: use the plugin as "
                               "`async with plugin:` around the scheduler loop")
        self.tracer.issue(op, list(request_ids))
        self.tasks.start_soon(self._run, op, call, hashes, host_pages, name=f"hicache {op.kind}")
        queue.push(op)

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
                part = call(hashes[start:stop], self.cache.host, host_pages[start:stop])
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

    def busy(self) -> bool:
        return len(self.backups) > 0 or len(self.prefetches) > 0

    def ready(self) -> tuple[int, list[int]]:
        """Leading backups this rank completed, and the pages each leading prefetch it can
        commit now fetched (0 for one its policy gives up on)."""
        policy = self.config.prefetch_policy
        now = time.monotonic()
        pages: list[int] = []
        for op in self.prefetches:
            if len(pages) == PREFETCH_SLOTS:
                break
            if op.done.query():
                pages.append(op.fetched_pages)
            elif (policy == "best_effort" and op.wanted) or now > op.deadline:
                pages.append(0)
            else:
                break
        return self.backups.ready(), pages

    def heads(self) -> list[CompletionEvent]:
        """Completion events of the ops that retire next: what an idle loop may wait on."""
        return [op.done for op in (self.backups.head(), self.prefetches.head()) if op is not None]

    def next_deadline(self) -> float:
        """When the head prefetch's policy gives up on it (monotonic; inf if none)."""
        head = self.prefetches.head()
        return head.deadline if head is not None else float("inf")

    # -- retire -----------------------------------------------------------------------------

    async def retire(self, step: int, *, backups: int, prefetch_pages: list[int]) -> list[StorageOp]:
        """Retire the agreed leading backups, and one leading prefetch per entry of
        `prefetch_pages`, committing that many of its pages; returns the prefetches."""
        for op in self.backups.retire(backups):
            await settle(op, step, self.tracer, self.config.sync_timeout_s)
            self.cache.unlock_host(op.node)
            self._count_errors(op)
        done = self.prefetches.retire(len(prefetch_pages))
        for op, pages in zip(done, prefetch_pages):
            if not op.done.query():
                op.cancel.set()      # the policy terminated it: stop the worker, keep what all have
                self.terminated += 1
            op.nbytes = pages * self.cache.host.layout.page_bytes
            await settle(op, step, self.tracer, self.config.sync_timeout_s, {"hicache.pages_committed": pages})
            self._commit(op, pages)
        self.tracer.metrics.queue_depth("backup", len(self.backups))
        self.tracer.metrics.queue_depth("prefetch", len(self.prefetches))
        return done

    def _commit(self, op: StorageOp, agreed_pages: int) -> None:
        """Graft the agreed pages under the prefix and free the rest. The op's task has ended
        (settled), so the host pages are quiet, and they are freed at the same step on every rank."""
        cache = self.cache
        cache.unpin(op.node)
        cache.note("prefetch-done", op.request_id, agreed_pages)
        unused = op.host_pages[agreed_pages:]
        if agreed_pages:
            unused += cache.graft(list(op.tokens), op.first_page, op.hashes, op.host_pages[:agreed_pages], op.salt)
        cache.free_host(unused)
        self._count_errors(op)

    def _count_errors(self, op: StorageOp) -> None:
        failed = 1 if isinstance(op.result, Exception) else getattr(op.result, "errors", 0)
        if failed:
            self.errors += failed
            log.warning("storage %s of %d pages had %d failed calls (%s); the cache carries on "
                        "without those pages", op.kind, op.pages, failed, op.result)

    # -- the owner's exit -------------------------------------------------------------------

    def stop(self) -> None:
        """Tell running prefetches to stop at their next object: nobody will wait for them."""
        for op in self.prefetches:
            op.cancel.set()

    def abandon(self) -> None:
        """Once no task runs: give back what unretired ops hold (a cancelled prefetch its host
        pages, a backup its host lock), so the cache is whole again."""
        for op in self.backups.retire(len(self.backups)):
            self.cache.unlock_host(op.node)
            self.tracer.abandoned(op)
        for op in self.prefetches.retire(len(self.prefetches)):
            self.cache.unpin(op.node)
            self.cache.free_host(op.host_pages)
            self.tracer.abandoned(op)


def _sum(a, b):
    """Two slices' results of one op as one: counts add up, per-page lists concatenate."""
    return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)})
