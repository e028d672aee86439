"""L3: backups (L2 -> L3) after write acks, and prefetches (L3 -> L2) on admission.

Storage calls run on a small thread pool so the event loop never waits on I/O. Both
kinds retire through ack queues and the per-step agreement, like L1/L2 ops: a prefetch
commits only the pages that every rank fetched (MIN), so trees stay identical.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN

from .agreement import PREFETCH_SLOTS
from .cache import TieredCache
from .config import CacheConfig
from .events import HostEvent
from .ops import AckQueue, CacheOp, StorageOp
from .page_store import PageStore
from .radix import Node

log = logging.getLogger(__name__)


class StorageTier:
    def __init__(self, cache: TieredCache, store: PageStore, config: CacheConfig) -> None:
        self.cache, self.store, self.config = cache, store, config
        self.on_issue = cache.on_issue
        self.backups = AckQueue("backup")
        self.prefetches = AckQueue("prefetch")
        self._workers = ThreadPoolExecutor(config.storage_workers, thread_name_prefix="hicache-l3")
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
        self._workers.submit(self._run, op, self.store.backup, op.hashes, self.cache.host, op.host_pages)
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
                       deadline=time.monotonic() + self.config.prefetch_timeout(n * self.config.page_size))
        self.on_issue(op, [request_id])
        self._workers.submit(self._run, op, self.store.prefetch, hashes[first_page:], self.cache.host,
                             pages, op.cancel)
        self.prefetches.push(op)
        return op

    @staticmethod
    def _run(op: StorageOp, call, *args) -> None:
        try:
            with trace.use_span(op.span or INVALID_SPAN, end_on_exit=False):  # storage spans nest under it
                op.result = call(*args)
        except Exception as exc:   # noqa: BLE001 - a worker must always complete its event
            op.result = exc
        finally:
            op.done.set()

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
            elif (policy == "best_effort" and op.wanted) or (policy == "timeout" and now > op.deadline):
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
        self._workers.shutdown(wait=True)
