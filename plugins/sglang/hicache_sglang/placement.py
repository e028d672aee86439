"""Where SGLang put this rank (`HiCacheStorageConfig`), as our rank coordinates and page layout.

TP and PP map straight onto `RankCoords`. Attention CP does not: a CP rank holds
its own slice of every page, not pages of its own, so its slice is part of what decides the
bytes and goes into the namespace (`engine_layout`); the key schemes then see one CP rank, and
every rank writes and reads its slice under keys no other slice shares. MLA KV is the same on
every TP rank: SGLang elects the writer (`is_storage_writer`), and the keys carry no TP rank.
"""
from __future__ import annotations

from hicache_async.errors import UsageError
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords

from .host_view import PoolShape
from .options import Options


def rank_coords(config) -> RankCoords:
    """TP and PP of this rank (attention TP where SGLang runs DP attention)."""
    return RankCoords(tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank,
                      pp_size=config.pp_size)


def kv_layout(config, shape: PoolShape, options: Options, model: str) -> KVLayout:
    """The KV this rank holds, its global layers and heads, and the namespace's ingredients
    (`model`: the model's id, see `identity`)."""
    slices = []
    if config.attn_cp_size > 1:
        slices.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    total_heads, first_head = 1, 0
    if shape.attention == "mha":
        total_heads, first_head = _heads(config, shape.heads, options.kv_heads)
        if total_heads is None:    # one head a rank, maybe a replica: share with this TP size only
            total_heads, first_head = shape.heads * config.tp_size, config.tp_rank * shape.heads
            slices.append(f"tp{config.tp_size}")
    return KVLayout(num_layers=shape.layers, kv_heads=shape.heads, head_dim=shape.head_dim,
                    page_size=shape.page_size, dtype=shape.dtype, attention=shape.attention,
                    first_layer=shape.first_layer, first_head=first_head, total_kv_heads=total_heads,
                    model_id=model, axes=shape.axes, engine_layout="|".join([shape.engine_layout, *slices]))


def _heads(config, local: int, model_heads: int | None) -> tuple[int | None, int]:
    """The model's kv heads and this rank's first, when they are known. Over several heads a
    rank, TP splits them; with one, the rank may hold a head it shares with other ranks (GQA
    at a TP above the heads), and only the model's head count (`kv_heads`) says which."""
    if model_heads is None:
        return (local * config.tp_size, config.tp_rank * local) if local > 1 or config.tp_size == 1 else (None, 0)
    if config.tp_size <= model_heads:
        if local * config.tp_size != model_heads:
            raise UsageError(f"hicache-async: kv_heads {model_heads} over tp {config.tp_size} is not the pool's "
                             f"{local} heads a rank")
        return model_heads, config.tp_rank * local
    if local != 1 or config.tp_size % model_heads:
        raise UsageError(f"hicache-async: kv_heads {model_heads} does not fit tp {config.tp_size} with {local} "
                         f"heads a rank")
    return model_heads, config.tp_rank // (config.tp_size // model_heads)


def head_group(config, layout: KVLayout, options: Options) -> int:
    """Heads an object holds under unified keys: as given, else SGLang's heterogeneous-TP split
    (`tp_lcm_size`), else all of this rank's heads (an MLA rank has one latent)."""
    if layout.attention == "mla":
        return 1
    if options.head_group is not None:
        return options.head_group
    if config.tp_lcm_size and config.tp_lcm_size > config.tp_size:
        return max(1, layout.total_kv_heads // config.tp_lcm_size)
    return layout.kv_heads
