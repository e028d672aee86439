"""Only host pools whose every byte of a page we store are attached: SGLang's DSA (NSA) stack,
whose index keys live in a second pool beside the MLA one, is refused as it attaches, as is a
pool class we do not know; SGLang's hybrid controller over a plain KV pool still attaches and
backs up through us."""
import threading

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.runtime_context import get_parallel

from hicache_async.errors import UsageError
from tests.plugins.sglang import harness as h

DSA_PAGE = 64    # DSA's index pages are 64 tokens


def _hybrid(device_pool, entries) -> HybridCacheController:
    """SGLang's hybrid controller over the group of `entries` (the anchor first), no storage yet."""
    group = HostPoolGroup(entries)
    return HybridCacheController(h.Allocator(device_pool), group, entries[0].host_pool.page_size, None,
                                 load_cache_event=threading.Event(), write_policy="write_through")


def _entry(name, host_pool, device_pool, anchor=False):
    return build_pool_entry(name=name, host_pool=host_pool, device_pool=device_pool,
                            layer_mapping={i: i for i in range(h.LAYERS)}, transfer_layer_id_max=h.LAYERS,
                            is_anchor=anchor)


@pytest.fixture
def one_rank():
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0):
        yield


@pytest.mark.timeout(120)
def test_a_dsa_stack_is_refused_as_it_attaches(dynamic, one_rank):
    """SGLang's own DSA device pool, its MLA anchor and indexer host pools, as its assembler
    pairs them (pinning off, for a CPU)."""
    device = DSATokenToKVPool(size=2 * DSA_PAGE, page_size=DSA_PAGE, kv_lora_rank=h.LATENT - 4, dtype=torch.float16,
                              qk_rope_head_dim=4, layer_num=h.LAYERS, device="cpu", index_head_dim=128,
                              enable_memory_saver=False, kv_cache_dim=h.LATENT)
    anchor = h.host_pool("mla", "page_first", pages=2, page=DSA_PAGE)
    _, indexer_decl = device.host_pool_decls()
    indexer = DSAIndexerPoolHost(indexer_decl, anchor, pin_memory=False)
    ctl = _hybrid(device, [_entry(PoolName.KV, anchor, device, anchor=True),
                           _entry(PoolName.INDEXER, indexer, device)])
    try:
        with pytest.raises(UsageError) as err:
            ctl.attach_storage_backend("dynamic", storage_backend_extra_config=dict(dynamic),
                                       host_pools=ctl.mem_pool_host.entries)
    finally:
        ctl.detach_storage_backend()
    assert "'indexer' (DSAIndexerPoolHost) is not supported" in str(err.value) and "\n" not in str(err.value)


class ScaledMHAHostPool(MHATokenToKVPoolHost):
    """A pool class we have not read: it might keep scales or other state per page."""


@pytest.mark.timeout(60)
def test_a_pool_class_we_do_not_know_is_refused(dynamic):
    pool = h.host_pool("mha", "page_first", cls=ScaledMHAHostPool)
    with pytest.raises(UsageError) as err:
        with h.controller(pool, "dynamic", dynamic):
            pass
    assert f"{__name__}.ScaledMHAHostPool is not supported" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.timeout(60)
def test_the_hybrid_controller_over_a_plain_pool_attaches_and_backs_up(dynamic, one_rank):
    pool = h.host_pool("mha", "page_first")
    device = h.device_pool("mha")
    ctl = _hybrid(device, [_entry(PoolName.KV, pool, device, anchor=True)])
    try:
        ctl.attach_storage_backend("dynamic", storage_backend_extra_config=dict(dynamic),
                                   host_pools=ctl.mem_pool_host.entries)
        assert ctl.page_set_func == ctl._page_set_zero_copy
        assert h.back_up(ctl, list(range(3 * h.PAGE)), pool.alloc(3 * h.PAGE)) == 3 * h.PAGE
    finally:
        ctl.detach_storage_backend()
