"""hicache-async inside vLLM: `HiCacheConnector`, a KV connector with a verified host tier and L3.

Load it by module path (`kv_connector_module_path="hicache_vllm"`) or, once installed, by
name alone (`kv_connector="HiCacheConnector"`, registered by `register`). The connector, which
imports vLLM, is imported when asked for: the scheduler and worker sides run without vLLM.
"""

__all__ = ["HiCacheConnector"]


def __getattr__(name: str):
    if name == "HiCacheConnector":
        from .connector import HiCacheConnector
        return HiCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
