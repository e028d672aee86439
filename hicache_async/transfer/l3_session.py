"""One L3 stack for every owner of a page store: the plugin, and the engine integrations.

A backend's adapter, sealed when a secret is given, under the deadline guard and the spans,
under a `PageStore` keyed by the chosen scheme. The plugin, the vLLM connector and the
SGLang backend all build it here, so a fix to how L3 is guarded or keyed reaches each.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from ..config import CacheConfig
from ..keys import make_key_scheme
from ..layout import KVLayout
from ..pools import HostPool
from ..storage.base import StorageAdapter, open_storage, storage_backend
from ..storage.guarded import GuardedStorage
from ..storage.sealed import SealedStorage, load_key
from ..storage.traced import TracedStorage
from ..topology import RankCoords
from .page_store import PageStore


def open_adapter(name: str, options: dict, secret_file: str | None = None) -> StorageAdapter:
    """The adapter registered as `name`, built with a session's `options`; sealed with the
    key derived from `secret_file` when one is given (each process reads the file itself)."""
    adapter = open_storage(name, **options)
    if secret_file is None:
        return adapter
    try:
        return SealedStorage(adapter, load_key(secret_file))
    except BaseException:
        adapter.close()
        raise


def guarded_store(adapter: StorageAdapter, name: str, layout: KVLayout, coords: RankCoords,
                  config: CacheConfig, head_group: int = 1, host: HostPool | None = None) -> PageStore:
    """A page store over `adapter`: every call under a deadline and the breaker, and traced.
    With cp_transfer "rank0", every CP rank names pages by CP rank 0's keys and reads what
    it wrote. `host`: the one host pool it serves; rank-suffix objects, each a whole page of
    it, then hold their bytes in its memory order where that takes fewer runs than ours
    (`HostPool.page_order`, named in the namespace), so they move in place. Unified objects
    keep our order: their keys are shared by every topology and pool."""
    if host is not None and config.key_scheme == "rank-suffix":
        layout = dataclasses.replace(layout, page_order=host.page_order)
    key_coords = dataclasses.replace(coords, cp_rank=0) if config.cp_transfer == "rank0" else coords
    keys = make_key_scheme(config.key_scheme, layout, key_coords, head_group)
    traced = TracedStorage(GuardedStorage(adapter, config), coords, name)
    return PageStore(traced, layout, keys, coords, cp_mode=config.cp_transfer)


@contextlib.contextmanager
def l3_session(name: str, options: dict, layout: KVLayout, coords: RankCoords, config: CacheConfig, *,
               secret_file: str | None = None, head_group: int = 1,
               host: HostPool | None = None) -> Iterator[PageStore]:
    """A page store for one process that is its own launcher (an engine's worker): the
    backend's session (a file store's directory, a Mooncake master checked reachable), its
    adapter and the guarded store (serving `host`, see `guarded_store`), all closed on exit."""
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(storage_backend(name).open_session(options))
        adapter = stack.enter_context(open_adapter(name, session, secret_file))
        yield guarded_store(adapter, name, layout, coords, config, head_group, host)
