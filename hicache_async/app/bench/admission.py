"""Cost of one admission against cache size: it must stay flat as the cache grows.

Eviction used to rescan and sort every node for each page it freed, so admission got
slower as the radix tree filled; this figure times a 100k-page cache against a 1k-page
one in the same run.
"""
from __future__ import annotations

import asyncio
import time

from ...config import CacheConfig
from ...hicache.cache import TieredCache
from ...hicache.ledger import StepMessage
from ...kinds import TransferKind
from ...layout import KVLayout
from ...transfer.pool import DevicePool, HostPool
from .figure import figure

PAGE = 16
LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_dim=1, page_size=PAGE)   # bytes do not matter here
GROUPS, SHARED, UNIQUE = 16, 2, 6      # 16 system prompts of 2 pages, each request adds 6 pages
HOST_PAGES = 256                       # same in both caches: write-backs per eviction are alike
HASHES = ["-"] * (SHARED + UNIQUE)     # no L3 here: keys are never read


class _Workload:
    """A write_back cache filled to `pages` device pages, then admitting one request at a time.

    Every eviction takes the LRU request (its device-only pages are written back first),
    so both sizes do the same work per admission; only the tree size differs.
    """

    def __init__(self, pages: int) -> None:
        cfg = CacheConfig(device_pages=pages, host_pages=HOST_PAGES, page_size=PAGE, write_policy="write_back")
        self.cache = TieredCache(cfg, DevicePool(LAYOUT, pages), HostPool(LAYOUT, HOST_PAGES))
        self.loop = asyncio.new_event_loop()     # retirement is awaited, as in `on_step`
        self.next_token = GROUPS * SHARED * PAGE
        self.requests = 0
        self.steps = 0
        for _ in range((pages - GROUPS * SHARED) // UNIQUE):   # fill without eviction: fast at any size
            self.admit()

    def _tokens(self) -> list[int]:
        g = self.requests % GROUPS
        self.requests += 1
        start, self.next_token = self.next_token, self.next_token + UNIQUE * PAGE
        return list(range(g * SHARED * PAGE, (g + 1) * SHARED * PAGE)) + list(range(start, self.next_token))

    def admit(self) -> None:
        """What `HiCachePlugin.admit` and `finish` ask of the cache for one request."""
        cache, tokens = self.cache, self._tokens()
        admitted = cache.admit(cache.match(tokens), len(tokens) // PAGE, self.requests)
        if admitted is None:
            raise RuntimeError("admission bench: nothing evictable")
        cache.finish(tokens, admitted.pages, HASHES, admitted.lock)

    def step(self) -> None:
        """Retire every write, as `on_step` would: written nodes become evictable again."""
        writes = self.cache.ledger.queues[TransferKind.WRITE]
        if len(writes):
            while not all(op.done.query() for op in writes):   # one FIFO copy worker, as on a rank
                time.sleep(1e-5)
            self.steps += 1
            retired = self.loop.run_until_complete(
                self.cache.ledger.retire(StepMessage(writes=len(writes)), self.steps))
            self.cache.retired(retired[TransferKind.WRITE])

    def us_per_admission(self, n: int) -> float:
        total = 0
        for _ in range(n):
            start = time.perf_counter_ns()
            self.admit()
            total += time.perf_counter_ns() - start
            self.step()
        return total / n / 1e3


def admission_scale(admissions: int, rounds: int, big_pages: int = 100_000, small_pages: int = 1_000) -> dict:
    """Median per-round µs per admission; rounds alternate sizes so noise hits both alike."""
    big, small = _Workload(big_pages), _Workload(small_pages)
    for w in (big, small):
        w.us_per_admission(admissions // 4)        # warm up: the first evictions write back a batch
    pairs = [(big.us_per_admission(admissions), small.us_per_admission(admissions)) for _ in range(rounds)]
    for w in (big, small):
        w.cache.close()
        w.loop.close()
    value = sorted(b for b, _ in pairs)[rounds // 2]
    baseline = sorted(s for _, s in pairs)[rounds // 2]
    return figure("admission_scale", value, "us", "admission_1k_pages_us", baseline)
