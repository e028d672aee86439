"""The byte layout of one rank's KV pages, shared by pools, transfers and storage."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .errors import UsageError

AXES = ("plane", "token", "head", "dim")


@dataclass(frozen=True)
class KVLayout:
    """KV held by one rank: a contiguous layer range and a contiguous kv-head range.

    MHA/GQA pages hold K and V planes per head; MLA pages hold one latent per token
    (one plane, one "head" of width `head_dim`) that every TP rank replicates.

    `axes` orders one layer of one page: ours is (plane, token, head, dim). An engine that
    owns its KV gives its own order (vLLM's CPU blocks are (head, token, dim), K and V packed
    in `dim`), so our host pages are its blocks byte for byte; only the head axis must be
    named, for keys that split heads. `engine_layout` names whatever else decides the bytes
    (the engine, its version family, its kernels' layout): both go into the namespace.
    `page_order` names the order of a whole page's bytes in its objects: "" for ours (layer by
    layer, each in `axes` order), else a host buffer's memory order (`HostPool.page_order`),
    set only for keys whose objects are one rank's whole pages; it goes into the namespace when
    set, so objects in one order miss, never misread, in another.
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
    axes: tuple[str, ...] = AXES
    engine_layout: str = ""
    page_order: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attention not in ("mha", "mla"):
            raise UsageError(f"unknown attention {self.attention!r}: expected mha or mla")
        axes = tuple(self.axes)
        if len(set(axes)) != len(axes) or not set(axes) <= set(AXES) or "token" not in axes:
            raise UsageError(f"page axes {','.join(axes)} must name token and, at most once each, "
                             f"plane, head and dim")
        object.__setattr__(self, "axes", axes)
        if not self.total_layers:
            object.__setattr__(self, "total_layers", self.num_layers)
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.kv_heads)

    @property
    def planes(self) -> int:
        """2 (K and V) for MHA, 1 (the latent) for MLA."""
        return 1 if self.attention == "mla" else 2

    @property
    def layer_page_shape(self) -> tuple[int, ...]:
        """Shape of one layer of one page, in `axes` order: by default (planes, page_size,
        kv_heads, head_dim)."""
        size = {"plane": self.planes, "token": self.page_size, "head": self.kv_heads, "dim": self.head_dim}
        return tuple(size[axis] for axis in self.axes)

    @property
    def head_axis(self) -> int | None:
        """Where the kv heads sit in `layer_page_shape`; None when heads are not an axis."""
        return self.axes.index("head") if "head" in self.axes else None

    @property
    def layer_page_bytes(self) -> int:
        return math.prod(self.layer_page_shape) * self.dtype.itemsize

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
            "layout=planes,tokens,heads,dim" if self.axes == AXES else "layout=" + ",".join(self.axes),
            *((self.engine_layout,) if self.engine_layout else ()),
            *((f"order={self.page_order}",) if self.page_order else ()),
        ))
        return hashlib.sha256(ident.encode()).hexdigest()[:16]
