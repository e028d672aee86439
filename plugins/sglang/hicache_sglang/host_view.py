"""SGLang's host KV pool seen as a `HostPool`: a view shaped (pages, layers, *layer page shape).

SGLang lays one buffer out four ways (`--hicache-mem-layout`); each is a permutation of the same
page, so a view over `kv_buffer` (no copy) gives the page store every page, layer and head
where SGLang keeps it. K and V sit in separate halves of an MHA buffer, so an MHA page is never
one run of bytes: in `layer_first` and `page_first_direct` it is a K and a V run a layer, which
the store reads and writes in place; in `page_first` it is a K and a V run in memory, which
rank-suffix objects hold in that order (`HostPool.page_order`) and so move in place too, while
unified objects (one layer or head group each) and `page_head` pages are runs of one token's
or head's few bytes, read through staging. An MLA page in `page_first_direct` is one run,
and a run a layer in `layer_first`. The layout's name goes into the namespace, so a pool laid
out another way misses instead of reading bytes in an order it did not write.

Only the two pool classes whose every byte lies in `kv_buffer` are keyed: a subclass or another
pool may hold more for a page (DSA indexer keys, MXFP8 scales), which a restored page would
lack. Classes are known by their qualified names, so the check needs no import of SGLang's
pool modules (which load model code).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_async.errors import UsageError

ENGINE_FAMILY = "sglang-0.5"
CANONICAL = ("plane", "token", "head", "dim")
HEAD_MAJOR = ("plane", "head", "token", "dim")   # page_head: heads outside tokens
LATENT = ("token", "head", "dim")                # MLA: one latent "head" a token
KNOWN_POOLS = {
    "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost": "mha",
    "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost": "mla",
}


@dataclass(frozen=True)
class PoolShape:
    """What the host pool holds, read off SGLang's pool object."""

    attention: str          # "mha" or "mla"
    layers: int
    heads: int
    head_dim: int
    page_size: int
    pages: int
    dtype: torch.dtype
    first_layer: int
    axes: tuple[str, ...]
    view: torch.Tensor      # (pages, layers, *layer page shape in `axes` order)
    engine_layout: str


def pool_attention(pool) -> str:
    """"mha" or "mla" for a pool class we key; a UsageError naming any other."""
    name = f"{type(pool).__module__}.{type(pool).__qualname__}"
    if name not in KNOWN_POOLS:
        raise UsageError(f"hicache-async: SGLang host pool {name} is not supported: its pages may hold more than "
                         f"kv_buffer; expected {' or '.join(KNOWN_POOLS)}")
    return KNOWN_POOLS[name]


def pool_shape(pool, attention: str) -> PoolShape:
    """The view and geometry of an `MHATokenToKVPoolHost` or `MLATokenToKVPoolHost`
    (`attention` "mha" or "mla")."""
    mla = attention == "mla"
    layout, kv, ps = pool.layout, pool.kv_buffer, pool.page_size
    if kv is None or not isinstance(kv, torch.Tensor):
        raise UsageError(f"hicache-async: host pool {type(pool).__name__} has no single KV buffer")
    heads, dim = (1, pool.kv_cache_dim) if mla else (pool.head_num, pool.head_dim)
    if not mla and getattr(pool, "v_head_dim", dim) != dim:
        raise UsageError(f"hicache-async: K width {dim} and V width {pool.v_head_dim} differ; not supported")
    layers = pool.layer_num
    view, axes = (_mla_view if mla else _mha_view)(kv, layout, ps, layers, heads, dim)
    return PoolShape("mla" if mla else "mha", layers, heads, dim, ps, view.shape[0], kv.dtype,
                     int(getattr(pool, "start_layer", 0) or 0), axes, view, f"{ENGINE_FAMILY}|{layout}")


def _whole_pages(kv: torch.Tensor, token_axis: int, ps: int) -> tuple[torch.Tensor, int]:
    """The buffer cut to whole pages along its token axis, and how many."""
    pages = kv.shape[token_axis] // ps
    return kv.narrow(token_axis, 0, pages * ps), pages


def _mha_view(kv, layout, ps, layers, heads, dim):
    if layout == "layer_first":      # (2, L, tokens, H, D)
        kv, pages = _whole_pages(kv, 2, ps)
        return kv.reshape(2, layers, pages, ps, heads, dim).permute(2, 1, 0, 3, 4, 5), CANONICAL
    if layout == "page_first":       # (2, tokens, L, H, D)
        kv, pages = _whole_pages(kv, 1, ps)
        return kv.reshape(2, pages, ps, layers, heads, dim).permute(1, 3, 0, 2, 4, 5), CANONICAL
    if layout == "page_first_direct":   # (2, pages, L, ps, H, D)
        return kv.permute(1, 2, 0, 3, 4, 5), CANONICAL
    if layout == "page_head":        # (2, pages, H, ps, L, D)
        return kv.permute(1, 4, 0, 2, 3, 5), HEAD_MAJOR
    raise UsageError(f"hicache-async: MHA host layout {layout!r} is not supported: expected layer_first, "
                     f"page_first, page_first_direct or page_head")


def _mla_view(kv, layout, ps, layers, heads, dim):
    if layout == "layer_first":      # (L, tokens, 1, D)
        kv, pages = _whole_pages(kv, 1, ps)
        return kv.reshape(layers, pages, ps, heads, dim).permute(1, 0, 2, 3, 4), LATENT
    if layout == "page_first":       # (tokens, L, 1, D)
        kv, pages = _whole_pages(kv, 0, ps)
        return kv.reshape(pages, ps, layers, heads, dim).permute(0, 2, 1, 3, 4), LATENT
    if layout == "page_first_direct":   # (pages, L, ps, 1, D): a page is one run of bytes
        return kv, LATENT
    raise UsageError(f"hicache-async: MLA host layout {layout!r} is not supported: expected layer_first, "
                     f"page_first or page_first_direct")
