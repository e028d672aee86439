"""vLLM's `vllm.general_plugins` entry point: runs in every vLLM process, so the connector is
known by name (`kv_connector="HiCacheConnector"`) to the scheduler and every worker alike."""
from __future__ import annotations

NAME = "HiCacheConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:     # plugins may load more than once a process
        KVConnectorFactory.register_connector(NAME, "hicache_vllm.connector", NAME)
