"""What one worker's KV blocks are, read from the tensors vLLM registers, as a `KVLayout`.

vLLM 0.32 gives every attention layer a logical [blocks, heads, tokens, content] view (content
packs K then V, or the MLA latent) whatever the physical order underneath. A host page is one
block of every layer in that logical order, so a page moves as a block does. Everything that
decides those bytes goes into the namespace: the model, dtype, block size, the per-layer
shape, the physical layout and backend, and vLLM's version family. A change of any of them
is a miss, never another layout's bytes read as this one's. A tensor that is not such a view
stops the engine at start-up rather than being guessed at. Under vLLM's hybrid KV cache manager
each KV cache group's layers are a layout of their own (`kv_groups.py`), numbered within the
group, and the group's kind, spec and layers go into its namespace. A Mamba or GDN layer's
view is [blocks, 1, 1, state bytes] of int8 (its conv and SSM states, the padding left out):
a page of such a group is one state block of each of its layers.
"""
from __future__ import annotations

import re

import torch

from hicache_async.errors import UsageError
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords

from .kv_groups import Group

AXES = ("head", "token", "dim")


def version_family(version: str) -> str:
    """"0.32.0" -> "vllm0.32": patch releases keep the layout, minor ones may not."""
    return "vllm" + ".".join(version.split(".")[:2])


def layer_index(name: str) -> int:
    """The global layer index in a vLLM layer name ("model.layers.7.self_attn.attn" -> 7)."""
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    if not found:
        raise UsageError(f"KV cache layer {name!r} names no layer index")
    return int(found[0])


def ordered_layers(kv_caches: dict[str, torch.Tensor]) -> list[str]:
    """Layer names by global index; they must be one contiguous run (one pipeline stage)."""
    names = sorted(kv_caches, key=layer_index)
    indices = [layer_index(n) for n in names]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise UsageError(f"KV cache layers {indices} are not one contiguous run of layers")
    return names


def worker_layout(kv_caches: dict[str, torch.Tensor], *, num_blocks: int, block_size: int, coords: RankCoords,
                  total_layers: int, total_kv_heads: int, mla: bool, model_id: str, engine: str,
                  group: Group | None = None) -> KVLayout:
    """The layout of this worker's KV (or of one `group`'s layers in it): its layers, its heads,
    and the namespace of its bytes."""
    names = ordered_layers(kv_caches) if group is None else sorted(kv_caches, key=layer_index)
    if group is not None:
        total_layers = len(names)
        engine += f"|group={group.spec}:layers={','.join(str(layer_index(n)) for n in names)}"
    first = kv_caches[names[0]]
    for name in names:
        t = kv_caches[name]
        if t.dim() != 4 or t.shape[0] != num_blocks or t.shape[2] != block_size:
            raise UsageError(f"KV cache of {name} is {tuple(t.shape)}: expected vLLM's logical [blocks={num_blocks}, "
                             f"heads, tokens={block_size}, content] view")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise UsageError(f"KV cache of {name} is {tuple(t.shape)} {t.dtype}, unlike {names[0]}'s "
                             f"{tuple(first.shape)} {first.dtype}")
    heads, content = first.shape[1], first.shape[3]
    replicas = max(1, coords.tp_size * heads // max(1, total_kv_heads))
    physical = ",".join(str(i) for i in sorted(range(4), key=lambda d: -first.stride(d)))
    return KVLayout(
        num_layers=len(names), kv_heads=heads, head_dim=content, page_size=block_size, dtype=first.dtype,
        attention="mla" if mla else "mha", first_layer=layer_index(names[0]) if group is None else 0,
        first_head=0 if mla else (coords.tp_rank // replicas) * heads,
        total_layers=total_layers, total_kv_heads=1 if mla else total_kv_heads, model_id=model_id,
        axes=AXES, engine_layout=f"{engine}|physical={physical}|device={first.device.type}")
