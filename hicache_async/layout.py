"""The byte layout of one rank's KV pages, shared by pools, transfers and storage."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .errors import UsageError


@dataclass(frozen=True)
class KVLayout:
    """KV held by one rank: a contiguous layer range and a contiguous kv-head range.

    MHA/GQA pages hold K and V planes per head; MLA pages hold one latent per token
    (one plane, one "head" of width `head_dim`) that every TP rank replicates.
    """

    num_layers: int          # layers this rank holds
    kv_heads: int            # kv heads this rank holds (1 for MLA)
    head_dim: int            # per-head width (latent width for MLA)
    page_size: int           # tokens per page
    dtype: torch.dtype = torch.float32
    attention: str = "mha"   # "mha" or "mla"
    first_layer: int = 0     # global index of this rank's first layer
    first_head: int = 0      # global index of this rank's first kv head
    total_layers: int = 0    # layers of the whole model (0: same as num_layers)
    total_kv_heads: int = 0  # kv heads of the whole model (0: same as kv_heads)
    model_id: str = "tiny-ref"

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention not in ("mha", "mla"):
            raise UsageError(f"unknown attention {self.attention!r}: expected mha or mla")
        if not self.total_layers:
            object.__setattr__(self, "total_layers", self.num_layers)
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.kv_heads)

    @property
    def planes(self) -> int:
        """2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.attention == "mla" else 2

    @property
    def layer_page_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer of one page: (planes, page_size, kv_heads, head_dim)."""
        return (self.planes, self.page_size, self.kv_heads, self.head_dim)

    @property
    def layer_page_bytes(self) -> int:
        p, s, h, d = self.layer_page_shape
        return p * s * h * d * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all of this rank's layers."""
        return self.num_layers * self.layer_page_bytes

    @property
    def last_layer(self) -> int:
        return self.first_layer + self.num_layers - 1

    @property
    def last_head(self) -> int:
        return self.first_head + self.kv_heads - 1

    def namespace(self) -> str:
        """Digest of everything that makes stored bytes meaningful, rank placement excluded.

        Two engines that differ in model, dtype, page size or byte layout get different
        namespaces, so their objects miss instead of colliding.
        """
        ident = "|".join(str(x) for x in (
            self.model_id, str(self.dtype).removeprefix("torch."), self.page_size,
            self.attention, self.total_layers, self.total_kv_heads, self.head_dim,
            "layout=planes,tokens,heads,dim",
        ))
        return hashlib.sha256(ident.encode()).hexdigest()[:16]
