"""Rotary embeddings, paged KV reads/writes and causal attention (GQA and MLA).

Math runs in float64; the KV that attention reads always comes back out of the float32
pages, so a run that reuses cached KV sees exactly the rounding a fresh run sees.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .weights import DTYPE, LayerWeights

if TYPE_CHECKING:
    from .config import ModelConfig


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x [n, heads, dim] at the given absolute positions."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=DTYPE) / half)
    angles = positions.to(DTYPE)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv(kv_layer: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor,
             rows: torch.Tensor) -> None:
    """Store rows [n, planes, heads, dim] at `positions` of a sequence whose pages are `pages`.

    kv_layer is one layer of the device pool: [num_pages, planes, page_size, heads, dim].
    """
    page_size = kv_layer.shape[2]
    kv_layer[pages[positions // page_size], :, positions % page_size] = rows.to(kv_layer.dtype)


def read_kv(kv_layer: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Rows [length, planes, heads, dim] for positions 0..length-1, as float64."""
    page_size = kv_layer.shape[2]
    positions = torch.arange(length)
    return kv_layer[pages[positions // page_size], :, positions % page_size].to(DTYPE)


def project(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [n, local_q_heads, q_dim] and the KV rows to store [n, planes, kv_heads, dim]."""
    d = cfg.head_dim
    if cfg.attention == "mha":
        q = rope((x @ w.wq).unflatten(-1, (-1, d)), positions, cfg.rope_theta)
        k = rope((x @ w.wk).unflatten(-1, (-1, d)), positions, cfg.rope_theta)
        return q, torch.stack((k, (x @ w.wv).unflatten(-1, (-1, d))), dim=1)
    q = (x @ w.wq).unflatten(-1, (-1, d + cfg.mla_rope_dim))
    q = torch.cat((q[..., :d], rope(q[..., d:], positions, cfg.rope_theta)), dim=-1)
    k_rope = rope((x @ w.w_kr).unsqueeze(1), positions, cfg.rope_theta).squeeze(1)
    return q, torch.cat((x @ w.w_dkv, k_rope), dim=-1)[:, None, None, :]


def attend(cfg: ModelConfig, w: LayerWeights, q: torch.Tensor, q_positions: torch.Tensor,
           cache: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [n, heads, q_dim] over cached rows [m, planes, kv_heads, dim].

    Returns [n, heads * head_dim], ready for the (row-parallel) output projection.
    """
    m, heads, d = cache.shape[0], q.shape[1], cfg.head_dim
    if cfg.attention == "mha":
        group = heads // cache.shape[2]
        keys = cache[:, 0].repeat_interleave(group, dim=1)
        values = cache[:, 1].repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, keys)
        scale = d ** -0.5
    else:
        latent, k_rope = cache[:, 0, 0, :cfg.mla_latent], cache[:, 0, 0, cfg.mla_latent:]
        keys = (latent @ w.w_uk).view(m, heads, d)
        values = (latent @ w.w_uv).view(m, heads, d)
        scores = (torch.einsum("nhd,mhd->hnm", q[..., :d], keys)
                  + torch.einsum("nhr,mr->hnm", q[..., d:], k_rope))
        scale = (d + cfg.mla_rope_dim) ** -0.5
    future = torch.arange(m)[None, :] > q_positions[:, None]
    probs = (scores * scale).masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, values).reshape(q.shape[0], heads * d)
