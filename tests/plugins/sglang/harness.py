"""SGLang's own host pools and HiCacheController, built small on a CPU, with no model.

The device pool is only what the controller reads at construction (its device, layer count,
type for MLA); the controller's backup and prefetch threads are SGLang's, driven as its radix
cache drives them: `write_storage`, and `prefetch` then the scheduler's hand-off of a hit
(host slots allocated, the operation put in `prefetch_buffer`).
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.runtime_context import get_context, get_parallel

from tests.helpers import starts

CPU = torch.device("cpu")
LAYERS, HEADS, DIM, LATENT, PAGE = 2, 4, 8, 12, 4
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def tiny_checkpoint(root: Path, weights: bytes = bytes(range(256)) * 64) -> Path:
    """A model folder as SGLang loads one: a config and a weights file (whose bytes the namespace names)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": LAYERS}))
    (root / "model.safetensors").write_bytes(weights)
    return root


def published(**server_args):
    """SGLang's server args published for this process (its other arguments at their defaults)."""
    return get_context().override_server_args(**server_args)


def host_pool(attention: str, layout: str, pages: int = 16, heads: int = HEADS, dtype=torch.float16,
              page: int = PAGE, cls=None):
    """A real SGLang host pool (of class `cls`, default SGLang's for `attention`) of `pages`
    pages (plus the slot SGLang reserves) over tiny device buffers."""
    tokens = pages * page
    common = dict(host_to_device_ratio=1.0, host_size=0, page_size=page, layout=layout, pin_memory=False,
                  device="cpu", device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS,
                  host_token_capacity=tokens)
    if attention == "mla":
        rows = tuple(torch.zeros(tokens + page, 1, LATENT, dtype=dtype) for _ in range(LAYERS))
        info = MLABufferInfo(buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(LAYERS)),
                             device_layer_num=LAYERS, page_size=page, kv_lora_rank=LATENT - 4,
                             qk_rope_head_dim=4, kv_cache_dim=LATENT, dtype=dtype, device=CPU)
        return (cls or MLATokenToKVPoolHost)(info, target_layer_num=LAYERS, **common)
    k = tuple(torch.zeros(tokens + page, heads, DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(tokens + page, heads, DIM, dtype=dtype) for _ in range(LAYERS))
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=DIM, v_head_dim=DIM, dtype=dtype, device=CPU)
    return (cls or MHATokenToKVPoolHost)(info, **common)


def _ptrs(tensors) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


class _DevicePool:
    """What the controller reads of a device pool; an MLA one must be an MLATokenToKVPool."""

    device, layer_num = CPU, LAYERS

    def register_layer_transfer_counter(self, counter) -> None:
        self.counter = counter


class _MLADevicePool(_DevicePool, MLATokenToKVPool):
    def __init__(self) -> None:
        pass


class _MHADevicePool(_DevicePool, MHATokenToKVPool):
    def __init__(self) -> None:
        pass


def device_pool(attention: str) -> _DevicePool:
    return _MLADevicePool() if attention == "mla" else _MHADevicePool()


class Allocator:
    """What the controller reads of a token allocator: its device pool."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def get_kvcache(self):
        return self.pool


@contextlib.contextmanager
def controller(pool, backend: str, extra: dict, *, tp=(0, 1), pp=(0, 1), model="tiny/model", metrics=False):
    """SGLang's HiCacheController over `pool` with L3 `backend` (storage metrics on with
    `metrics`), its threads stopped on exit."""
    starts.started("SGLang controller", f"{backend} tp{tp[0]}of{tp[1]} pp{pp[0]}of{pp[1]}")
    with get_parallel().override(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1],
                                 attn_dcp_size=1, attn_dcp_rank=0):
        attention = "mla" if isinstance(pool, MLATokenToKVPoolHost) else "mha"
        ctl = HiCacheController(Allocator(device_pool(attention)), pool, PAGE, tp_group=None,
                                load_cache_event=threading.Event(), write_policy="write_through",
                                storage_backend=backend, model_name=model,
                                storage_backend_extra_config=dict(extra), enable_storage_metrics=metrics)
    try:
        yield ctl
    finally:
        ctl.detach_storage_backend()


def back_up(ctl, tokens: list[int], host_indices: torch.Tensor, timeout_s: float = 30.0) -> int:
    """Tokens the controller's backup thread stored, with SGLang's own page hashes."""
    from sglang.srt.mem_cache.utils import get_hash_str

    hashes, prior = [], None
    for start in range(0, len(tokens) - PAGE + 1, PAGE):
        prior = get_hash_str(tokens[start:start + PAGE], prior)
        hashes.append(prior)
    ctl.write_storage(host_indices, tokens, hash_value=hashes)
    return ctl.ack_backup_queue.get(timeout=timeout_s).completed_tokens


def prefetch(ctl, pool, tokens: list[int], timeout_s: float = 30.0) -> tuple[int, torch.Tensor]:
    """Tokens the controller's prefetch threads loaded into fresh host slots, and those slots."""
    op = ctl.prefetch("req", tokens)
    hit = ctl.prefetch_hit_queue.get(timeout=timeout_s)
    assert hit is op
    if not op.hash_value:
        return 0, torch.empty(0, dtype=torch.int64)
    op.host_indices = pool.alloc(len(op.hash_value) * PAGE)
    ctl.prefetch_buffer.put(op)
    deadline, done = time.monotonic() + timeout_s, 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if ack.completed_tokens is not None:
            done = ack.completed_tokens
        if ack.completed_req:
            return done, op.host_indices
