"""A small Llama written to a local folder with seeded random weights of a sensible scale.

vLLM's `load_format="dummy"` gives near-zero weights, so every logit is about equal and a
wrong KV byte hardly shows; weights scaled by 1/sqrt(fan-in) make each token's logits, and
so greedy outputs and their logprobs, depend on every KV byte.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_llama(path: Path, *, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                vocab: int = 1024, intermediate: int = 512, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "head_dim": head_dim,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * scale / cols ** 0.5).to(torch.bfloat16)

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "lm_head.weight": weight(vocab, hidden, 4.0),
               "model.norm.weight": ones}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": weight(intermediate, hidden),
            p + "mlp.up_proj.weight": weight(intermediate, hidden),
            p + "mlp.down_proj.weight": weight(hidden, intermediate),
            p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones})
    save_file({k: v.clone() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path
