"""Block <-> host page copies, layer by layer: on CPU, and on a CUDA copy stream with events
(skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch
from hicache_vllm.layer_copies import LayerCopies
from hicache_vllm.plan import Move

from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_saved_blocks_load_back_into_other_blocks_layer_by_layer(device):
    layout = KVLayout(num_layers=3, kv_heads=2, head_dim=16, page_size=8, dtype=torch.bfloat16,
                      axes=("head", "token", "dim"))
    kv = [torch.randn(10, 2, 8, 16, device=device).to(torch.bfloat16) for _ in range(3)]
    copies = LayerCopies(kv, HostPool(layout, 4))
    copies.save([Move("a", [3, 1], [7, 2])])
    copies.load([Move("b", [3, 1], [0, 5])])
    for layer in range(3):
        copies.wait_layer(layer)
        if device == "cuda":
            torch.cuda.current_stream().synchronize()
        assert torch.equal(kv[layer][0], kv[layer][7]) and torch.equal(kv[layer][5], kv[layer][2])
    copies.wait_all()
