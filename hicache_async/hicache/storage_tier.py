"""L3: backups (L2 -> L3) after write acks, and prefetches (L3 -> L2) on admission.

Storage calls run on worker threads so the event loop never waits on I/O: backups and
prefetches on pools of their own, so a burst of backups never delays a prefetch a request
waits on. An op runs as slices of SLICE_PAGES, each queued behind whatever was submitted
meanwhile, so a long op shares the workers with short ones instead of holding them up.
Both kinds retire through ack queues and the per-step agreement, like L1/L2 ops: a
prefetch commits only the pages that every rank fetched (MIN), so trees stay identical.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN

from ..parallel.agreement import PREFETCH_SLOTS
from .cache import TieredCache
from ..config import CacheConfig
from ..transfer.events import HostEvent
from .ops import AckQueue, CacheOp, StorageOp
from ..transfer.page_store import PageStore
from .radix import Node

log = logging.getLogger(__name__)
SLICE_PAGES = 64   # pages a worker moves before the op goes back in the queue


class StorageTier:
    def __init__(self, cache: TieredCache, store: PageStore, config: CacheConfig) -> None:
        self.cache, self.store, self.config = cache, store, config
        self.on_issue = cache.on_issue
        self.backups = AckQueue("backup")
        self.prefetches = AckQueue("prefetch")
        self._backup_workers = ThreadPoolExecutor(config.storage_workers, thread_name_prefix="hicache-backup")
        self._prefetch_workers = ThreadPoolExecutor(config.storage_workers, thread_name_prefix="hicache-prefetch")
        self.errors = 0

    # -- issue ------------------------------------------------------------------------------

    def backup(self, write: CacheOp) -> StorageOp:
        """Copy a retired write's host pages to storage; the host pages stay locked till then."""
        page_bytes = self.cache.host.layout.page_bytes
        op = StorageOp("backup", write.node, [HostEvent()], write.pages, write.pages * page_bytes,
                       hashes=write.hashes, host_pages=write.host_pages)
        self.cache.tree.lock_host(write.node)
        self.cache.note("backup", write.node.id, write.pages)
        self.on_issue(op, [])
        self._backup_workers.submit(self._slice, self._backup_workers, op, self.store.backup, op.hashes,
                                    op.host_pages, 0)
        self.backups.push(op)
        return op

    def prefetch(self, request_id: int, parent: Node | None, tokens: list[int], first_page: int,
                 hashes: list[str]) -> StorageOp | None:
        """Fetch pages `first_page..` of `tokens` into fresh host pages; None if no room."""
        n = len(hashes) - first_page
        with self.cache.holding(parent):      # making room must not evict what we graft onto
            pages = self.cache.alloc_host(n)
        if pages is None:
            return None
        self.cache.tree.pin(parent)
        self.cache.note("prefetch", request_id, first_page, n)
        op = StorageOp("prefetch", parent, [HostEvent()], n, n * self.cache.host.layout.page_bytes,
                       request_id=request_id, hashes=hashes, host_pages=pages, tokens=tuple(tokens),
                       first_page=first_page,
                       deadline=time.monotonic() + self._patience(n))
        self.on_issue(op, [request_id])
        self._prefetch_workers.submit(self._slice, self._prefetch_workers, op,
                                      functools.partial(self.store.prefetch, cancel=op.cancel),
                                      hashes[first_page:], pages, 0)
        self.prefetches.push(op)
        return op

    def _slice(self, workers: ThreadPoolExecutor, op: StorageOp, call, hashes: list[str],
               host_pages: list[int], start: int) -> None:
        """Move one slice of the op's pages, then queue the next one, or complete the op.

        A prefetch stops at the first slice that did not fetch every page (the leading run
        ended) or once cancelled; results add up slice by slice.
        """
        stop = min(start + SLICE_PAGES, len(hashes))
        try:
            with trace.use_span(op.span or INVALID_SPAN, end_on_exit=False):  # storage spans nest under it
                part = call(hashes[start:stop], self.cache.host, host_pages[start:stop])
            op.result = part if start == 0 else _sum(op.result, part)
            whole = getattr(part, "pages", stop - start) == stop - start
            if stop < len(hashes) and whole and not op.cancel.is_set():
                workers.submit(self._slice, workers, op, call, hashes, host_pages, stop)
                return
        except Exception as exc:   # noqa: BLE001 - a worker must always complete its event
            op.result = exc
        op.done.set()

    def _patience(self, pages: int) -> float:
        """Seconds a prefetch may run before it is terminated: the timeout policy's budget, and
        for the other policies the cap, so a hung backend never stalls a request for good."""
        cfg = self.config
        if cfg.prefetch_policy == "timeout":
            return cfg.prefetch_timeout(pages * cfg.page_size)
        return cfg.prefetch_timeout_max_s

    # -- this rank's view for the agreement ---------------------------------------------------

    def prefetch_view(self) -> tuple[int, list[int]]:
        """Leading prefetches this rank can commit now, and how many pages each commits."""
        policy = self.config.prefetch_policy
        now = time.monotonic()
        pages: list[int] = []
        for op in self.prefetches:
            if len(pages) == PREFETCH_SLOTS:
                break
            if op.done.query():
                pages.append(self._fetched(op))
            elif (policy == "best_effort" and op.wanted) or now > op.deadline:
                pages.append(0)
            else:
                break
        return len(pages), pages

    def _fetched(self, op: StorageOp) -> int:
        return op.result.pages if hasattr(op.result, "pages") else 0

    # -- retire -----------------------------------------------------------------------------

    def retire_backup(self, op: StorageOp) -> None:
        self.cache.tree.lock_host(op.node, -1)
        self._count_errors(op)

    def retire_prefetch(self, op: StorageOp, agreed_pages: int) -> None:
        """Graft the agreed pages under the prefix and free the rest.

        The caller has awaited the worker (cancelled if the policy terminated it), so the
        host pages are quiet and are freed at the same step on every rank.
        """
        cache = self.cache
        cache.tree.pin(op.node, -1)
        cache.note("prefetch-done", op.request_id, agreed_pages)
        unused = op.host_pages[agreed_pages:]
        if agreed_pages:
            unused += cache.tree.graft_host(list(op.tokens), op.first_page, op.hashes,
                                            op.host_pages[:agreed_pages])
        cache.host.alloc.release(unused)
        self._count_errors(op)

    def _count_errors(self, op: StorageOp) -> None:
        failed = 1 if isinstance(op.result, Exception) else getattr(op.result, "errors", 0)
        if failed:
            self.errors += failed
            log.warning("storage %s of %d pages had %d failed calls (%s); the cache carries on "
                        "without those pages", op.kind, op.pages, failed, op.result)

    def close(self) -> None:
        for op in self.prefetches:
            op.cancel.set()
        self._prefetch_workers.shutdown(wait=True)
        self._backup_workers.shutdown(wait=True)


def _sum(a, b):
    """Two slices' results of one op as one: counts add up, per-page lists concatenate."""
    return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)})
