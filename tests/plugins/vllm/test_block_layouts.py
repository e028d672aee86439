"""BlockCopies over the per-layer views vLLM 0.32 itself builds (`create_kv_cache_views`), in
every KV cache layout it knows, for K and V packed in content and for an MLA latent: byte-exact
round trips, or a one-line refusal where a block is a run per token and head."""
from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec, compute_layout_strides,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout

from hicache_async.errors import UsageError
from hicache_async.transfer.block_copies import BlockCopies
from tests.helpers.block_round_trips import assert_round_trip, host_pool, random_bytes

LAYERS, BLOCKS = 3, 8
SPECS = {"packed": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16),
         "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=12, dtype=torch.bfloat16)}


def _vllm_views(spec, layout: KVCacheLayout):
    """The raw buffer and a function giving vLLM's per-layer views over a buffer like it, laid
    out as vLLM's KV cache config lays out one group's layers."""
    page = spec.page_size_bytes
    block_stride = page * LAYERS if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout,
                                                            fixed_strides=(None, block_stride, None, None, None))
    placement = KVCacheTensor(size=page * LAYERS * BLOCKS, layers=[f"model.layers.{i}.attn" for i in range(LAYERS)],
                              layer_stride=layer_stride, block_stride=block_stride)
    return random_bytes(placement.size, seed=3), lambda raw: create_kv_cache_views(
        raw.view(torch.int8), spec, BLOCKS, layout, placement)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
@pytest.mark.parametrize("content", SPECS)
def test_every_vllm_layout_round_trips_or_is_refused(layout, content):
    raw, layers = _vllm_views(SPECS[content], layout)
    token_major = layout.layer_view_order.index(2) < layout.layer_view_order.index(1)   # tokens outside heads
    if token_major and content != "mla":
        kv = layers(raw)
        with pytest.raises(UsageError, match="runs of 32 bytes, more than one a head"):
            BlockCopies(kv, host_pool(kv, 4))
        return
    assert_round_trip(raw, layers, slots=[9, 0, 4, 6], blocks=[7, 2, 0, 5], targets=[1, 3, 6, 4])
