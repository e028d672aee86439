"""hicache-async inside vLLM: `HiCacheConnector`, a KV connector with a verified host tier and L3.

Load it by module path (`kv_connector_module_path="hicache_vllm"`) or, once installed, by
name alone (`kv_connector="HiCacheConnector"`, registered by `register`).
"""
from .connector import HiCacheConnector

__all__ = ["HiCacheConnector"]
