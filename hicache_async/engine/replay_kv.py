"""The replay engine's KV: bytes that are a pure function of a page's prefix and coordinates.

A full page's chained hash fixes every token up to its end, so the KV of element
(page, global layer, plane, offset, global head, dim) is mixed from 32 bits of the page's
hash and a per-element constant of the whole model, sliced to this rank's layers and heads.
Any tier, rank or process can then say what a cached page must hold from its hash alone,
which is how every reused page is verified byte for byte (a wrong page passes by chance
with probability 2**-32). 32-bit lanes halve the cost of 64-bit ones: at trace scale this
function runs over billions of elements.

Values are float16 built from bits: sign, exponent 14 or 15 and 10 random mantissa bits,
so every value is finite, exact and in +-[0.5, 2); no rounding ever depends on batching.
"""
from __future__ import annotations

import numpy as np
import torch

from .splitmix import splitmix64

_SALT = np.uint64(0x6B76_7265_706C_6179)    # "kvreplay": this function's version
_MULT = np.uint32(0x9E3779B1)
_SIGN_MANTISSA = np.uint16(0x87FF)
_EXPONENT = np.uint16(0x3800)


def page_seed(digest: bytes) -> int:
    """The 32 bits of a page's hash that seed its KV; `int(hex[:8], 16)` of its hex form."""
    return int.from_bytes(digest[:4], "big")


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

    def pages(self, seeds: list[int], layer: int | None = None) -> torch.Tensor:
        """float16 KV of the pages with these seeds, layer-major like the device pool:
        [layers, pages, planes, ps, heads, dim], or [pages, planes, ps, heads, dim] of one
        local layer."""
        table = self._table if layer is None else self._table[layer:layer + 1]
        x = table[:, None, :] ^ np.asarray(seeds, dtype=np.uint32)[None, :, None]
        x *= _MULT
        bits = (x >> np.uint32(16)).astype(np.uint16)
        bits &= _SIGN_MANTISSA
        bits |= _EXPONENT
        kv = torch.from_numpy(bits.view(np.float16)).view(len(table), len(seeds), *self.shape[1:])
        return kv if layer is None else kv[0]

    def expected(self, hashes: list[str], layer: int) -> torch.Tensor:
        """What `KVCheck` compares with: the KV of one local layer of pages named by hex hash."""
        return self.pages([page_seed(bytes.fromhex(h[:8])) for h in hashes], layer)
