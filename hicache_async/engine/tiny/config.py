"""The tiny reference model's shape and seed: what its weights, and so its KV, are a function of."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ...errors import UsageError


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 4
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    attention: str = "mha"  # "mha" (GQA) or "mla"
    mla_latent: int = 32    # MLA stores latent + rope part per token, one vector replicated on TP
    mla_rope_dim: int = 8
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise UsageError(f"unknown attention {self.attention!r}: expected mha or mla")
        if self.q_heads % self.kv_heads:
            raise UsageError(f"q_heads {self.q_heads} is not a multiple of "
                             f"kv_heads {self.kv_heads}")
        for name in ("head_dim", "mla_rope_dim"):
            if getattr(self, name) % 2:
                raise UsageError(f"{name} must be even for rotary embeddings, "
                                 f"got {getattr(self, name)}")

    @property
    def model_id(self) -> str:
        """Names the weights, so KV from another seed or shape never matches in storage."""
        return "tiny-ref-" + hashlib.sha256(repr(self).encode()).hexdigest()[:12]
