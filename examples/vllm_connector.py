"""hicache-async inside vLLM: a prefix served by vLLM's own cache, by our host tier, and by L3.

    .venv/bin/python examples/vllm_connector.py [--model PATH]   # a local Hugging Face model folder

Without `--model` it writes a small Llama with seeded random weights and runs that.

The same long prompt three ways: once computed, once after `reset_prefix_cache()` (vLLM's own
cache is empty: the prefix comes from our host tier), and once in a second engine process over
the same L3 directory. Each prints where its prefix came from; the greedy tokens must match.
On vLLM's CPU build, set `VLLM_ENABLE_V1_MULTIPROCESSING=0` for a quick start.
"""
import argparse
import json
import multiprocessing
import os
import random
import tempfile
from pathlib import Path

from hicache_async.app.bench.vllm_engine import write_llama


def serve(model: str, storage_path: str, prompt: list[int], resets: bool) -> list[dict]:
    """One engine with the connector; the prompt served once (twice with a reset between)."""
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
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(serve, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a local model folder (config.json and weights)")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="hicache-example-") as root:
        model = args.model or str(write_llama(Path(root) / "llama"))
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
