"""`async with plugin:` owns the storage workers: none outlives it, a cancelled prefetch gives
its host pages back, and an error from the loop comes out as it was raised."""
import time

import anyio
import pytest

from hicache_async.api import EngineContext
from hicache_async.config import CacheConfig
from hicache_async.errors import DivergenceError, HiCacheError
from hicache_async.hicache.plugin import HiCachePlugin
from hicache_async.hicache.storage_tier import SLICE_PAGES
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.kinds import TransferKind
from hicache_async.pools import DevicePool, HostPool
from hicache_async.request import Request
from hicache_async.topology import RankCoords
from hicache_async.transfer.page_store import PageStore
from tests.helpers.fake_storages import SlowStorage
from tests.helpers.layouts import LAYOUT

LONG = 5 * SLICE_PAGES
CONFIG = CacheConfig(device_pages=LONG + 8, host_pages=LONG + 8, page_size=4, prefetch_threshold=4,
                     storage_timeout_s=30)
PROMPT = list(range(4 * LONG + 1))      # LONG full pages before the last token, all stored
READ_S = 0.02                           # per object: a slice takes over a second, the whole 5 s


def _plugin() -> tuple[HiCachePlugin, SlowStorage]:
    """A plugin over storage that holds the whole prompt and reads it slowly: its prefetch
    runs for seconds, slice after slice."""
    storage = SlowStorage()
    pages = list(range(LONG))
    PageStore(storage, LAYOUT, make_key_scheme("rank-suffix", LAYOUT)).backup(
        page_hashes(PROMPT[:-1], 4), HostPool(LAYOUT, LONG), pages)
    storage.seconds_per_object = READ_S
    plugin = HiCachePlugin(CONFIG, storage=storage, storage_name="slow")
    plugin.attach(EngineContext(LAYOUT, DevicePool(LAYOUT, CONFIG.device_pages), RankCoords()))
    return plugin, storage


def _host_free(plugin: HiCachePlugin) -> int:
    return plugin.cache.host.alloc.free


async def test_exit_stops_a_running_prefetch_and_gives_its_host_pages_back():
    plugin, _ = _plugin()
    req = Request(1, PROMPT, max_new=1)
    async with plugin:
        assert not plugin.admit(req) and plugin.fetching(req)      # it waits for its prefetch
        op = plugin.ledger.queues[TransferKind.PREFETCH].head()
        assert _host_free(plugin) == CONFIG.host_pages - LONG
        await anyio.sleep(0.2)                                       # a slice is being read
        exiting = time.monotonic()
    took = time.monotonic() - exiting
    assert op.done.query(), "the prefetch task outlived the plugin"
    assert 0 < op.result.pages < LONG, "the prefetch ran to the end instead of stopping"
    assert took < (LONG - 2 * SLICE_PAGES) * READ_S, f"exit waited {took:.2f} s for the whole prefetch"
    assert not plugin.busy() and _host_free(plugin) == CONFIG.host_pages


async def test_an_error_in_the_loop_propagates_as_raised_and_still_stops_the_workers():
    plugin, _ = _plugin()
    with pytest.raises(DivergenceError, match="^boom$"):
        async with plugin:
            plugin.admit(Request(1, PROMPT, max_new=1))
            op = plugin.ledger.queues[TransferKind.PREFETCH].head()
            await anyio.sleep(0.05)
            raise DivergenceError("boom")
    assert op.done.query() and not plugin.busy() and _host_free(plugin) == CONFIG.host_pages


def test_storage_work_outside_the_plugin_context_is_refused():
    plugin, _ = _plugin()
    with pytest.raises(HiCacheError, match="async with plugin"):
        plugin.admit(Request(1, PROMPT, max_new=1))
