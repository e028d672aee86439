"""A small seeded host pool, its page store and a secret file: what the store tests share."""
import os

import torch

from hicache_async.keys import make_key_scheme
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.transfer.page_store import PageStore

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)


def secret_file(path, size: int = 32, mode: int = 0o600) -> str:
    path.write_bytes(os.urandom(size))
    path.chmod(mode)
    return str(path)


def seeded_host(seed: int = 0) -> HostPool:
    host = HostPool(LAYOUT, 4)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return host


def page_store(adapter, scheme: str = "rank-suffix") -> PageStore:
    return PageStore(adapter, LAYOUT, make_key_scheme(scheme, LAYOUT, head_group=1))
