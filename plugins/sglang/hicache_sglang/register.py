"""`sglang.srt.plugins` entry point: makes `hicache-async` a storage backend name in SGLang.

SGLang 0.5.23's factory registers names, but builds only the names of its own list, and its
controller takes the zero-copy v1 calls only for its own backends and for `dynamic` with
`interface_v1`. Two hooks through SGLang's plugin registry close both gaps for this one name;
every other name goes through untouched.
"""
from __future__ import annotations

NAME = "hicache-async"
_FACTORY = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory"
_CONTROLLER = "sglang.srt.managers.cache_controller.HiCacheController"


def register() -> None:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    StorageBackendFactory.register_backend(NAME, "hicache_sglang", "HiCacheAsyncStorage")
    HookRegistry.register(f"{_FACTORY}._create_builtin_backend", _build, HookType.AROUND)
    HookRegistry.register(f"{_CONTROLLER}.attach_storage_backend", _take_v1, HookType.AROUND)


def _build(original, cls, backend_name, backend_class, storage_config, mem_pool_host):
    """Ours is built as `dynamic` builds it: `Cls(storage_config, {})`, the pool registered after."""
    if backend_name == NAME:
        return backend_class(storage_config, {})
    return original(cls, backend_name, backend_class, storage_config, mem_pool_host)


def _take_v1(original, controller, *args, **kwargs):
    """After attaching ours by name, page I/O goes through its v1 calls (host indices, no copies)."""
    result = original(controller, *args, **kwargs)
    if controller.storage_backend_type == NAME:
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    return result
