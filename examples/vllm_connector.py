"""hicache-async inside vLLM: a prefix served by vLLM's own cache, by our host tier, and by L3.

    .venv/bin/python examples/vllm_connector.py            # or --model PATH, a local model folder

Without `--model` it writes a small Llama with seeded random weights and runs that (no download).

The same long prompt three ways: once computed, once after `reset_prefix_cache()` (vLLM's own
cache is empty: the prefix comes from our host tier), and once in a second engine process over
the same L3 directory. Each prints where its prefix came from; the greedy tokens must match.
Each engine runs in a fresh Python process of its own, as a server restart would; vLLM's
scheduler and its worker share that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), where `vllm
serve` gives each a process of its own. The connector works either way; a process each would
import vLLM twice more an engine.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

RESULT = "ENGINE-RESULT "


def serve(model: str, storage_path: str, prompt: list[int], resets: bool) -> list[dict]:
    """One engine with the connector (by name: `pip install` registers it with vLLM); the
    prompt served once, or twice with vLLM's prefix cache reset between."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=4096,
              kv_cache_memory_bytes=256 << 20,
              kv_transfer_config={"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
                                  "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"storage": "file", "storage_path": storage_path}})
    greedy = SamplingParams(max_tokens=16, temperature=0)
    out = []
    for _ in range(2 if resets else 1):
        r = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0]
        out.append({"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens,
                    "from": (r.kv_transfer_params or {}).get("hicache")})
        llm.reset_prefix_cache()
    return out


def in_new_process(*args) -> list[dict]:
    """`serve(*args)` in a fresh Python process (this file, with `--serve`)."""
    done = subprocess.run([sys.executable, __file__, "--serve", json.dumps(args)], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        sys.exit(f"the engine process exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def write_llama(path: Path, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                vocab: int = 1024, ffn: int = 512) -> str:
    """A Llama with seeded random weights scaled by 1/sqrt(fan-in), so its greedy tokens depend on
    every KV byte (vLLM's dummy weights would make every logit about equal)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    dim = hidden // heads
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": dim, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    g = torch.Generator().manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols ** 0.5).to(torch.bfloat16)

    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_heads * dim, hidden),
              "self_attn.v_proj": (kv_heads * dim, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}
    norms = ("input_layernorm", "post_attention_layernorm")
    ones = [f"model.layers.{i}.{n}.weight" for i in range(layers) for n in norms]
    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden) * 4,
               **{f"model.layers.{i}.{n}.weight": w(*s) for i in range(layers) for n, s in shapes.items()},
               **{n: torch.ones(hidden, dtype=torch.bfloat16) for n in [*ones, "model.norm.weight"]}}
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local model folder (config.json and weights)")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--serve", help=argparse.SUPPRESS)     # one engine's arguments, as JSON: see in_new_process
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")       # a local folder: nothing to fetch
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")    # one process an engine (see above)
    if args.serve:
        print(RESULT + json.dumps(serve(*json.loads(args.serve))), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="hicache-example-") as root:
        model = args.model or write_llama(Path(root) / "llama")
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        prompt = [random.Random(0).randrange(3, vocab) for _ in range(args.prompt_tokens)]
        l3 = f"{root}/l3"
        computed, from_host = in_new_process(model, l3, prompt, True)
        (from_l3,) = in_new_process(model, l3, prompt, False)
    for name, r in (("computed", computed), ("host tier", from_host), ("L3, new process", from_l3)):
        print(f"{name:>16}: {r['cached']:5d} cached tokens  {json.dumps(r['from'])}")
    assert computed["tokens"] == from_host["tokens"] == from_l3["tokens"], "outputs differ"
    print("greedy outputs identical")


if __name__ == "__main__":
    main()
