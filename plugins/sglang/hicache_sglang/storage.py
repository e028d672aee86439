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

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache_async.errors import UsageError
from hicache_async.keys import tenant_digest
from hicache_async.pools import HostPool
from hicache_async.transfer.l3_session import l3_session
from hicache_async.transfer.objects import NO_TENANT

from .host_view import pool_shape
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
        self.writer = storage_config.is_storage_writer
        self.store = self.host = None
        self._session = contextlib.ExitStack()

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        shape = pool_shape(mem_pool_host)
        layout = kv_layout(self.config, shape, self.options)
        coords = rank_coords(self.config)
        if layout.attention == "mla":   # the same latent on every TP rank: SGLang elects the writer
            coords = dataclasses.replace(coords, tp_rank=0, tp_size=1)
        self.layout, self.page_size = layout, shape.page_size
        self.host = HostPool(layout, shape.pages, tensor=shape.view)
        o = self.options
        self.store = self._session.enter_context(l3_session(
            o.storage, o.backend_options, layout, coords, o.cache_config(), secret_file=o.secret_file,
            head_group=head_group(self.config, layout, o)))

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
            result = self.store.prefetch(list(keys), self.host, self._pages(keys, host_indices),
                                         tenant=_tenant(extra_info))
            got = result.pages
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
            return self.store.backup(list(keys), self.host, self._pages(keys, host_indices),
                                     tenant=_tenant(extra_info)).ok
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
        c = self.store.counters if self.store is not None else None
        return None if c is None else {name: getattr(c, name) for name in (
            "corrupt_objects", "forged_objects", "missing_objects", "storage_errors", "bytes_written", "bytes_read")}


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
