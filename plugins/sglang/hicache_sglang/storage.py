"""`HiCacheAsyncStorage`: SGLang's HiCache L3 interface over hicache-async's page store.

SGLang's controller owns the device<->host copies and the host pool; this class only moves
host pages to and from L3, through the same stack as the plugin (`l3_session`: adapter,
seal, deadline guard and breaker, spans, key scheme), so every object is checksummed on the
way out and verified before SGLang is told a page arrived. The data path never raises: a
failure is False, and a page that fails is False with every page after it in the batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache_async.errors import UsageError
from hicache_async.keys import tenant_digest
from hicache_async.pools import HostPool
from hicache_async.transfer.l3_session import l3_session
from hicache_async.transfer.objects import NO_TENANT

from .figures import IntervalFigures
from .host_view import pool_attention, pool_shape
from .identity import model_id
from .options import parse_options
from .placement import head_group, kv_layout, rank_coords

log = logging.getLogger(__name__)
LATE_WARN_S = 10.0    # how often a read still running after its deadline is reported


class HiCacheAsyncStorage(HiCacheStorage):
    """Built by SGLang as `Cls(storage_config, {})`; the host pool arrives afterwards, through
    `register_mem_pool_host`, and only then is L3 opened (its keys need the pool's layout)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.config = storage_config
        self.options = parse_options(storage_config.extra_config)
        if getattr(storage_config, "dcp_size", 1) > 1:
            raise UsageError("hicache-async: decode context parallel (dcp) is not supported")
        self.model_id = model_id(storage_config, self.options.model_id)
        self.writer = storage_config.is_storage_writer
        self.figures = IntervalFigures(storage_config.enable_storage_metrics)
        self.store = self.host = None
        self._session = contextlib.ExitStack()

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang's host pool (a hybrid stack's KV anchor): a class we key, else a UsageError."""
        self.attach_host_pool(mem_pool_host, pool_attention(mem_pool_host))

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A hybrid stack's pools: the KV anchor is ours already; any other (DSA indexer keys,
        Mamba or SWA state) we do not store, and a page restored without its part is wrong KV."""
        if host_pool is not getattr(self, "mem_pool_host", None):
            raise UsageError(f"hicache-async: SGLang host pool {str(host_pool_name)!r} "
                             f"({type(host_pool).__name__}) is not supported: only the KV pool is stored")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def attach_host_pool(self, pool, attention: str) -> None:
        """Open L3 over `pool`, laid out as SGLang's `attention` ("mha" or "mla") host pool;
        for a caller that vouches for its pool's class (the bench's stand-in)."""
        super().register_mem_pool_host(pool)
        shape = pool_shape(pool, attention)
        layout = kv_layout(self.config, shape, self.options, self.model_id)
        coords = rank_coords(self.config)
        if layout.attention == "mla":   # the same latent on every TP rank: SGLang elects the writer
            coords = dataclasses.replace(coords, tp_rank=0, tp_size=1)
        self.layout, self.page_size = layout, shape.page_size
        self.host = HostPool(layout, shape.pages, tensor=shape.view)
        o = self.options
        self.store = self._session.enter_context(l3_session(
            o.storage, o.backend_options, layout, coords, o.cache_config(), secret_file=o.secret_file,
            head_group=head_group(self.config, layout, o), host=self.host))

    def close(self) -> None:
        self.store = None
        self._session.close()

    # -- the v1 data path ------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self.store is None or not keys:
            return 0
        try:
            return self.store.stored_run(list(keys))
        except Exception:
            log.exception("hicache-async: existence probe failed")
            return 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """The leading run of pages read and verified into the host pool: True each, then False."""
        try:
            start = time.perf_counter()
            result = self.store.prefetch(list(keys), self.host, self._pages(keys, host_indices),
                                         tenant=_tenant(extra_info))
            got = result.pages
            self.figures.record("prefetch", got, result.bytes, time.perf_counter() - start)
            _until_returned(result.late)
        except Exception:
            log.exception("hicache-async: prefetch of %d pages failed", len(keys))
            got = 0
        return [i < got for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Each page stored (or already there); a rank that is not the writer of replicated KV
        acknowledges without writing, as SGLang's own backends do."""
        if not self.writer:
            return [True] * len(keys)
        try:
            start = time.perf_counter()
            result = self.store.backup(list(keys), self.host, self._pages(keys, host_indices),
                                       tenant=_tenant(extra_info))
            self.figures.record("backup", result.pages, result.bytes, time.perf_counter() - start)
            return result.ok
        except Exception:
            log.exception("hicache-async: backup of %d pages failed", len(keys))
            return [False] * len(keys)

    def _pages(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        """Host page of each key: page i starts at token slot host_indices[i * page_size]."""
        if host_indices.numel() != len(keys) * self.page_size:
            raise ValueError(f"{host_indices.numel()} host slots for {len(keys)} pages of {self.page_size}")
        return (host_indices[::self.page_size] // self.page_size).tolist()

    # -- the generic path SGLang still declares abstract -------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        """Unused (SGLang takes the v1 path for this backend): a miss, never unverified bytes."""
        return None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [None] * len(keys)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return False

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return False

    def get_stats(self):
        """SGLang's `StorageMetrics` for the batches since the last call (see `figures`)."""
        return self.figures.take(self.store.counters if self.store is not None else None)


def _tenant(extra_info: HiCacheStorageExtraInfo | None) -> bytes:
    """The tenant a salted request's pages belong to; SGLang folds `cache_salt` into its page
    hashes, and a caller that also passes it in `extra_info` gets its objects tagged."""
    salt = ((extra_info.extra_info if extra_info is not None else None) or {}).get("cache_salt")
    return tenant_digest(salt) if isinstance(salt, str) and salt else NO_TENANT


def _until_returned(late: list) -> None:
    """Block until every read given up on has returned. It may still write into SGLang's host
    pages, which SGLang frees and reuses as soon as we answer, and only SGLang could hold them:
    so we answer late, as SGLang's own backends (which have no deadline) always do. Its other
    calls fail fast meanwhile: the breaker is open."""
    for call in late:
        done = threading.Event()
        call.when_returned(done.set)
        while not done.wait(LATE_WARN_S):
            log.warning("hicache-async: a storage read given up on has not returned after %.0f s; SGLang's "
                        "host pages it may write into are held until it does", LATE_WARN_S)
