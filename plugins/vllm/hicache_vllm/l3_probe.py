"""An L3 miss answered on the scheduler, at once: is the first page a prefetch would read there?

A prefetch parks its request for an engine step while every worker reads; for a prompt no tier
has seen (each prefix's first use) that step only learns that nothing is stored. One existence
check of the first missing page, by the keys the workers read, learns it before the request is
parked. A worker names a page's objects `page_hash + suffix` (rank-suffix keys: one suffix;
unified: one a layer and head group) and reports its suffixes once (`key_suffixes`). A prefetch
stops at its first missing object, so a page whose first object some worker lacks is a prefetch
of nothing: the probe says so (`absent`). Where it cannot tell (a worker not reported yet, a
failed or late call) it says nothing, and the prefetch goes ahead: a probe may save a step,
never lose a hit.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from hicache_async.config import CacheConfig
from hicache_async.errors import StorageError
from hicache_async.keys import KeyScheme
from hicache_async.storage.base import StorageAdapter, storage_backend
from hicache_async.storage.guarded import GuardedStorage
from hicache_async.transfer.l3_session import open_adapter

PROBE_TIMEOUT_S = 0.05      # the scheduler's thread waits this long at most; then the prefetch decides
_ANY_HASH = "0" * 32        # a page hash to read a scheme's suffixes off


def key_suffixes(keys: KeyScheme) -> list[str]:
    """What a worker reports once: the suffix of each object key its scheme gives a page."""
    return [spec.key[len(_ANY_HASH):] for spec in keys.objects(_ANY_HASH)]


class L3Probe:
    def __init__(self, adapter: StorageAdapter, workers: int) -> None:
        self.adapter, self.workers = adapter, workers
        self._first: dict[object, str] = {}    # per worker: the suffix of its first object of a page

    def learn(self, worker: object, suffixes: list[str]) -> None:
        """A worker's `key_suffixes`; only its first object decides a miss."""
        if suffixes:
            self._first[worker] = suffixes[0]

    def absent(self, page_hash: str) -> bool:
        """True only when some worker surely finds no object for the page: then a prefetch
        from it reads nothing."""
        if len(self._first) < self.workers:
            return False
        keys = [page_hash + suffix for suffix in dict.fromkeys(self._first.values())]
        try:
            return self.adapter.batch_exists(keys) < len(keys)
        except StorageError:
            return False


@contextlib.contextmanager
def open_probe(name: str, options: dict, config: CacheConfig, workers: int) -> Iterator[L3Probe]:
    """A probe over its own session and adapter of the `name` backend, each call under a
    `PROBE_TIMEOUT_S` deadline and the breaker. Existence needs no secret: sealing keeps keys."""
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(storage_backend(name).open_session(options))
        adapter = stack.enter_context(open_adapter(name, session))
        guarded = GuardedStorage(adapter, dataclasses.replace(config, storage_timeout_s=PROBE_TIMEOUT_S))
        yield L3Probe(guarded, workers)
