"""hicache-async: a hierarchical KV cache (device → host → storage) for an asyncio scheduler loop.

The public face: all an embedder needs. An engine implements nothing here; it calls a
`KVPlugin` (ours is `HiCachePlugin`) at a few points of its loop and hands it an
`EngineContext` (its layout, device pool and rank placement, and for a world of several
ranks a `PipelineAgreement` over its `ParallelGroups`). Names load on
first use, so `hicache_async.keys` and `hicache_async.partition` stay cheap to import.
"""
from importlib import import_module

_PUBLIC = {
    "KVPlugin": "api", "EngineContext": "api", "load_plugin": "api",
    "Request": "request", "CacheConfig": "config", "KVLayout": "layout",
    "DevicePool": "pools", "HostPool": "pools", "OpClock": "clock", "TransferKind": "kinds",
    "RankCoords": "topology", "ParallelGroups": "parallel.groups",
    "Agreement": "parallel.agreement", "LocalAgreement": "parallel.agreement",
    "PipelineAgreement": "parallel.pp_sync",
    "HiCachePlugin": "hicache.plugin", "StorageAdapter": "storage.base", "open_storage": "storage.base",
    "MemoryStorage": "storage.memory", "FileStorage": "storage.file",
    "HiCacheError": "errors", "UsageError": "errors", "StorageError": "errors",
    "SyncTimeout": "errors", "DivergenceError": "errors", "PoolExhausted": "errors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'hicache_async' has no attribute {name!r}")
    return getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
