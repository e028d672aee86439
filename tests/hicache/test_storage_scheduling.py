"""No head-of-line blocking on the L3 workers: short ops are not held up behind long ones."""
import contextlib

import anyio

from hicache_async.config import CacheConfig
from hicache_async.events import HostEvent
from hicache_async.hicache.cache import TieredCache
from hicache_async.hicache.ops import CacheOp
from hicache_async.hicache.storage_tier import SLICE_PAGES, StorageTier
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.kinds import TransferKind
from hicache_async.pools import DevicePool, HostPool
from hicache_async.transfer.page_store import PageStore
from tests.helpers.fake_storages import SlowStorage
from tests.helpers.layouts import LAYOUT

LONG = 5 * SLICE_PAGES


@contextlib.asynccontextmanager
async def slow_tier():
    """One worker per kind of op, the worst case for head-of-line blocking, over stored pages;
    its ops run in a task group, as under the plugin."""
    cfg = CacheConfig(device_pages=8, host_pages=2 * LONG + 8, page_size=4, storage_workers=1)
    cache = TieredCache(cfg, DevicePool(LAYOUT, 8), HostPool(LAYOUT, 2 * LONG + 8))
    storage = SlowStorage()
    store = PageStore(storage, LAYOUT, make_key_scheme("rank-suffix", LAYOUT))
    async with anyio.create_task_group() as tasks:
        yield StorageTier(cache, store, cfg, tasks), storage
    cache.close()


def _tokens(first: int, pages: int) -> list[int]:
    return list(range(first, first + 4 * pages))


def _prefetch(tier, request_id, tokens):
    return tier.prefetch(request_id, tier.cache.tree.root, tokens, 0, page_hashes(tokens, 4))


async def _wait(op) -> None:
    await op.done.wait(30, op.kind)


async def test_a_short_prefetch_completes_before_a_long_one_issued_first():
    async with slow_tier() as (tier, storage):
        long_tokens, short_tokens = _tokens(0, LONG), _tokens(10**6, 2)
        for tokens in (long_tokens, short_tokens):
            pages = list(range(len(tokens) // 4))
            assert tier.store.backup(page_hashes(tokens, 4), tier.cache.host, pages).ok == [True] * len(pages)
        storage.seconds_per_object = 0.002
        long, short = _prefetch(tier, 1, long_tokens), _prefetch(tier, 2, short_tokens)
        await _wait(short)
        assert not long.done.query(), "the short prefetch waited for the whole long one"
        await _wait(long)
        assert (short.result.pages, long.result.pages, long.result.errors) == (2, LONG, 0)
        assert long.result.bytes == LONG * (tier.store.counters.bytes_read // (LONG + 2))


async def test_a_prefetch_is_not_held_up_behind_a_long_backup():
    async with slow_tier() as (tier, storage):
        short_tokens = _tokens(10**6, 2)
        assert tier.store.backup(page_hashes(short_tokens, 4), tier.cache.host, [0, 1]).ok == [True] * 2
        storage.seconds_per_object = 0.002
        long_tokens = _tokens(0, LONG)
        write = CacheOp(TransferKind.WRITE, tier.cache.tree.root, [HostEvent()], LONG, 0,
                        hashes=page_hashes(long_tokens, 4), host_pages=list(range(LONG)))
        tier.back_up([write])
        backup = tier.ledger.queues[TransferKind.BACKUP].head()
        prefetch = _prefetch(tier, 1, short_tokens)
        await _wait(prefetch)
        assert not backup.done.query(), "the prefetch waited for the backup"
        await _wait(backup)
        assert prefetch.result.pages == 2 and backup.result.ok == [True] * LONG
