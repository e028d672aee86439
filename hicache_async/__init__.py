"""hicache-async: a hierarchical KV cache (device → host → storage) for an asyncio scheduler loop.

The public face: all an embedder needs. An engine implements nothing here; it calls a
`KVPlugin` (ours is `HiCachePlugin`) at a few points of its loop and hands it an
`EngineContext` (its layout, device pool and rank placement, and for a world of several
ranks a `PipelineAgreement` over its `ParallelGroups`). Names load on first use
(`lazy_loader`), so importing the package, or a torch-free part of it such as
`hicache_async.partition`, does not pay for torch.
"""
import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "api": ["KVPlugin", "EngineContext", "load_plugin"],
    "request": ["Request"], "config": ["CacheConfig"], "layout": ["KVLayout"],
    "pools": ["DevicePool", "HostPool"], "clock": ["OpClock"], "kinds": ["TransferKind"],
    "topology": ["RankCoords"], "parallel.groups": ["ParallelGroups"],
    "parallel.agreement": ["Agreement", "LocalAgreement"], "parallel.pp_sync": ["PipelineAgreement"],
    "hicache.plugin": ["HiCachePlugin"], "storage.base": ["StorageAdapter", "open_storage"],
    "storage.memory": ["MemoryStorage"], "storage.file": ["FileStorage"],
    "errors": ["HiCacheError", "UsageError", "StorageError", "SyncTimeout", "DivergenceError", "PoolExhausted"],
})
