"""Seeded random weights, built per layer so a pipeline stage builds only its own layers.

Every tensor comes from a generator seeded by (model seed, part name), drawn whole and then
sliced for the tensor-parallel rank, so any split sees exactly the values one rank would.
Norm gains are 1 and therefore not stored.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import ModelConfig

DTYPE = torch.float64


def _generator(seed: int, part: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _matrix(gen: torch.Generator, fan_in: int, fan_out: int) -> torch.Tensor:
    """std 1/sqrt(fan_in) keeps activations O(1) through every projection."""
    return torch.randn(fan_in, fan_out, generator=gen, dtype=DTYPE) / fan_in ** 0.5


@dataclass
class LayerWeights:
    """One layer's weights as this TP rank holds them (head-sliced where attention is split).

    MHA uses wq, wk, wv; MLA uses wq (nope + rope per head), w_dkv, w_kr, w_uk, w_uv.
    wo holds the rows of the local heads (row-parallel); the MLP is replicated.
    """

    wq: torch.Tensor
    wo: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    wk: torch.Tensor | None = None
    wv: torch.Tensor | None = None
    w_dkv: torch.Tensor | None = None
    w_kr: torch.Tensor | None = None
    w_uk: torch.Tensor | None = None
    w_uv: torch.Tensor | None = None


def _heads(w: torch.Tensor, width: int, heads: range) -> torch.Tensor:
    """Columns of the given heads, each `width` wide."""
    return w[:, heads.start * width:heads.stop * width].contiguous()


def layer_weights(cfg: ModelConfig, layer: int, q_heads: range, kv_heads: range) -> LayerWeights:
    gen = _generator(cfg.seed, f"layer{layer}")
    h, d = cfg.hidden, cfg.head_dim
    if cfg.attention == "mha":
        wq = _matrix(gen, h, cfg.q_heads * d)
        wk = _matrix(gen, h, cfg.kv_heads * d)
        wv = _matrix(gen, h, cfg.kv_heads * d)
        attn = dict(wq=_heads(wq, d, q_heads), wk=_heads(wk, d, kv_heads),
                    wv=_heads(wv, d, kv_heads))
    else:
        wq = _matrix(gen, h, cfg.q_heads * (d + cfg.mla_rope_dim))
        attn = dict(
            wq=_heads(wq, d + cfg.mla_rope_dim, q_heads),
            w_dkv=_matrix(gen, h, cfg.mla_latent),
            w_kr=_matrix(gen, h, cfg.mla_rope_dim),
            w_uk=_heads(_matrix(gen, cfg.mla_latent, cfg.q_heads * d), d, q_heads),
            w_uv=_heads(_matrix(gen, cfg.mla_latent, cfg.q_heads * d), d, q_heads),
        )
    wo = _matrix(gen, cfg.q_heads * d, h)[q_heads.start * d:q_heads.stop * d].contiguous()
    return LayerWeights(wo=wo, w_gate=_matrix(gen, h, cfg.ffn), w_up=_matrix(gen, h, cfg.ffn),
                        w_down=_matrix(gen, cfg.ffn, h), **attn)


def embedding(cfg: ModelConfig) -> torch.Tensor:
    """[vocab, hidden], unit scale: the residual stream starts O(1)."""
    return torch.randn(cfg.vocab, cfg.hidden, generator=_generator(cfg.seed, "embed"), dtype=DTYPE)


def lm_head(cfg: ModelConfig) -> torch.Tensor:
    """[hidden, vocab]; untied from the embedding so logits are not dominated by the last token."""
    return _matrix(_generator(cfg.seed, "lm_head"), cfg.hidden, cfg.vocab)
