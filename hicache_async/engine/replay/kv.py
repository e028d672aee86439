"""The replay engine's KV: bytes that are a pure function of a page's prefix and coordinates.

A page is named from the trace alone (`replay_trace.prompt_page_ids`: the tenant, the block
ids up to the page's block and its offset there; pages holding outputs by their request's
prompt and place), never by the cache's page hashes, so a bug in those cannot make a wrong
page look right. The KV of element (page, global layer, plane, offset, global head, dim) is
mixed from 32 bits of the page's name and a per-element constant of the whole model, sliced
to this rank's layers and heads. Any tier, rank or process can then say what a cached page
must hold, which is how every reused page is verified byte for byte (a wrong page passes by
chance with probability 2**-32), and a hit across tenants is a mismatch. 32-bit lanes halve
the cost of 64-bit ones: at trace scale this function runs over billions of elements.

Values are float16 built from bits: sign, exponent 14 or 15 and 10 random mantissa bits,
so every value is finite, exact and in +-[0.5, 2); no rounding ever depends on batching.
"""
from __future__ import annotations

import numpy as np
import torch

from ...request import Request
from .splitmix import splitmix64

_SALT = np.uint64(0x6B76_7265_706C_6179)    # "kvreplay": this function's version
_MULT = np.uint32(0x9E3779B1)
_SIGN_MANTISSA = np.uint16(0x87FF)
_EXPONENT = np.uint16(0x3800)


class ReplayKV:
    """The KV of one rank's layers and heads; the whole model has `total_layers` layers and
    `total_heads` kv heads, two planes (K, V) of `head_dim` each per token."""

    def __init__(self, total_layers: int, total_heads: int, head_dim: int, page_size: int,
                 layers: range, heads: range) -> None:
        shape = (total_layers, 2, page_size, total_heads, head_dim)
        index = np.arange(np.prod(shape), dtype=np.uint64).reshape(shape)
        table = (splitmix64(index ^ _SALT) >> np.uint64(32)).astype(np.uint32)
        table = table[layers.start:layers.stop, :, :, heads.start:heads.stop, :]
        self.shape = table.shape                       # (layers, planes, page_size, heads, dim)
        self._table = np.ascontiguousarray(table).reshape(len(layers), -1)

    def pages(self, page_ids, layer: int | None = None) -> torch.Tensor:
        """float16 KV of the pages with these 64-bit names, layer-major like the device pool:
        [layers, pages, planes, ps, heads, dim], or [pages, planes, ps, heads, dim] of one
        local layer."""
        table = self._table if layer is None else self._table[layer:layer + 1]
        seeds = (np.asarray(page_ids, dtype=np.uint64) >> np.uint64(32)).astype(np.uint32)
        x = table[:, None, :] ^ seeds[None, :, None]
        x *= _MULT
        bits = (x >> np.uint32(16)).astype(np.uint16)
        bits &= _SIGN_MANTISSA
        bits |= _EXPONENT
        kv = torch.from_numpy(bits.view(np.float16)).view(len(table), len(seeds), *self.shape[1:])
        return kv if layer is None else kv[0]

    # -- the truth `KVCheck` compares with ------------------------------------------------------

    @staticmethod
    def page_ids(req: Request, pages: int) -> np.ndarray:
        """The names of `req`'s first `pages` prompt pages, from its trace line."""
        return req.tag.prompt_ids[:pages]

    def expected(self, page_ids, layer: int) -> torch.Tensor:
        return self.pages(page_ids, layer)
