"""Runs one real vLLM engine (CPU build) in this process and prints what it generated.

A test starts it as a subprocess with a JSON spec, so every engine is a fresh process (as a
restart of a server is) and vLLM's process-wide state never leaks between tests. The spec:
model, dtype, tp, block_size, the connector's extra config (None: no connector) and steps,
each `generate` (prompt ids, optional cache_salt), `reset` (vLLM's prefix cache) or `kill`
(SIGKILL a pid: a storage server dying mid-run).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

MARK = "ENGINE-RESULTS "


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if spec.get("tp", 1) == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = None
    if spec.get("extra") is not None:
        transfer = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": spec["extra"]}
        if not spec.get("by_name"):
            transfer["kv_connector_module_path"] = "hicache_vllm"
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec.get("dtype", "bfloat16"),
              kv_cache_memory_bytes=spec.get("kv_bytes", 64 << 20), max_model_len=spec.get("max_len", 2048),
              block_size=spec.get("block_size", 32), tensor_parallel_size=spec.get("tp", 1),
              kv_transfer_config=transfer, disable_log_stats=False)
    results = []
    for step in spec["steps"]:
        if step["op"] == "reset":
            llm.reset_prefix_cache()
            continue
        if step["op"] == "kill":
            os.kill(step["pid"], signal.SIGKILL)
            continue
        sp = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0, logprobs=3)
        prompt = TokensPrompt(prompt_token_ids=step["prompt"])
        if step.get("salt"):
            prompt["cache_salt"] = step["salt"]
        started = time.monotonic()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        results.append({"seconds": time.monotonic() - started, "tokens": list(out.outputs[0].token_ids),
                        "logprobs": [{str(k): v.logprob for k, v in d.items()} for d in out.outputs[0].logprobs],
                        "cached": out.num_cached_tokens, "params": out.kv_transfer_params})
    print(MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
