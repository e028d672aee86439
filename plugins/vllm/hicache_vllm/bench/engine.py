"""One real vLLM engine (CPU build) in a fresh process, for the vLLM figures and tests.

`python -m hicache_vllm.bench.engine SPEC_JSON` prints one JSON line: per `generate`
step its seconds (TTFT with max_tokens=1), greedy tokens, top-k logprobs, `num_cached_tokens`
and `kv_transfer_params`. A fresh process per engine is what a server restart is, and keeps
vLLM's process-wide state out of the next engine. The spec: model, dtype, tp, block_size,
`load_format` (vLLM's: "dummy" is random weights), the connector (None, "HiCacheConnector",
by module path or with `by_name` by its entry point, or "ExampleConnector") and its extra
config, `lora_rank` (LoRA on, adapters up to that rank),
`prompt_embeds` (prompt embeddings on), `async_scheduling` (vLLM's GPU default, which its CPU
platform turns off: turned back on; tp=1), named `prompts`, and `steps`: `generate` (a prompt or
a prompt's name, optional `salt`, `max_tokens`, `logprobs`, `prompt_logprobs`, `lora`
[name, id, path], or `embeds_seed` for seeded random prompt embeddings of `embeds_len`
tokens in place of a prompt), `generate_many` (`prompts`, a list of prompts or names, submitted
together so they share engine steps; a result each, `seconds` the batch's), `reset` (vLLM's
prefix cache), `kill` (SIGKILL a pid: a storage server dying mid-run) or `settle` (wait, at
most `timeout` seconds, until this process's backups have ended: what a process's exit
would flush; one process, tp=1, only).

A spec without `steps` is an engine that lives on (`Engine`): it says it is ready, then runs
each line of stdin as a JSON list of steps, one result line each, until stdin closes. Many
tests' steps then pay for one engine start.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hicache_async.errors import HiCacheError

from . import launch

MARK = "VLLM-BENCH "
READY = "ready"
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
TIMEOUT_S = 600
SETTLE_S = 60


def write_llama(path: Path, *, layers: int = 8, hidden: int = 512, heads: int = 8, kv_heads: int | None = None,
                vocab: int = 2048, intermediate: int = 1024, logit_scale: float = 1.0, seed: int = 0) -> Path:
    """A Llama with seeded random weights scaled by 1/sqrt(fan-in): vLLM's `load_format="dummy"`
    gives near-zero weights, every logit about equal, so a wrong KV byte hardly shows; with these,
    greedy tokens and their logprobs depend on every KV byte. The default is sized so prefill
    dominates a 2,000-token TTFT (512 KiB of bf16 KV a 32-token block); a `logit_scale` above 1
    widens the gaps between logits, so greedy tokens survive another TP's rounding."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    dim, kv_heads = hidden // heads, kv_heads or heads
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "bfloat16", "head_dim": dim, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols ** 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden) * logit_scale,
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv_heads * dim, hidden),
              "self_attn.v_proj": (kv_heads * dim, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
              "mlp.down_proj": (hidden, intermediate)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({f"{p}{name}.weight": w(rows, cols) for name, (rows, cols) in shapes.items()})
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_tokenizer(path: Path, vocab: int = 2048) -> Path:
    """A word-level tokenizer for `write_llama`'s model (id i is the word `t{i}`, no special
    tokens), so any ids decode to text that encodes back to the same ids: what a client that
    sends text (`vllm bench serve`) needs for exact prompt lengths and shared prefixes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "model_max_length": 4096}))
    return path


def write_lora(path: Path, model: Path, *, rank: int = 8, seed: int = 1) -> Path:
    """A PEFT LoRA adapter on q/k/v of every layer of `model`, with seeded random A and B
    large enough to change the KV (and so the greedy tokens) of every layer."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj"], "bias": "none", "base_model_name_or_path": str(model)}))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            p = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{p}.lora_A.weight"] = (torch.randn(rank, hidden, generator=g) / hidden ** 0.5).contiguous()
            tensors[f"{p}.lora_B.weight"] = (torch.randn(out, rank, generator=g) / rank ** 0.5).contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def run_engine(spec: dict, env: dict | None = None, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """What each `generate` step of a fresh engine process gave; a failed engine is an
    EngineFailed naming its exit code and the end of its stderr."""
    proc = start_engine(spec, env, timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise EngineFailed(f"vllm engine ({spec.get('connector')}) exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(MARK):])


def start_engine(spec: dict, env: dict | None = None, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """The finished engine process, whatever its exit (killed past `timeout_s`)."""
    args = [sys.executable, "-m", __name__, json.dumps(spec)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = launch.popen(args, stdout=out, stderr=err, env=engine_environment(spec, env), text=True)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, proc.returncode, out.read(), err.read())


def engine_environment(spec: dict, env: dict | None) -> dict:
    """The environment an engine of `spec` starts with (a pool of engines keys by it)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    env.setdefault(THREADS_BIND, pinned_threads(spec.get("tp", 1)))
    if spec.get("tp", 1) == 1:      # one process: starts in seconds, not a minute
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


class Engine:
    """An engine process that lives on (a spec without steps): each `run` sends it a batch of steps and waits, at
    most `timeout_s`, for their results. An engine that fails a batch or outlives a wait is
    gone (killed, with its process group) and the failure is an EngineFailed naming the end
    of its stderr. `close` ends it as a fresh process ends: stdin closed, its connector's
    flush; interpreter exit closes what is left."""

    def __init__(self, spec: dict, env: dict | None = None, start_timeout_s: float = TIMEOUT_S) -> None:
        self.spec = spec
        self._stderr = tempfile.TemporaryFile()
        self.proc = launch.popen([sys.executable, "-m", __name__, json.dumps(spec)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                 env=engine_environment(spec, env), start_new_session=True)
        self._answers: queue.Queue = queue.Queue()     # parsed result lines; None at EOF
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)
        if self._answer(start_timeout_s, "to start") != READY:
            self.kill()
            raise EngineFailed(f"vllm engine ({spec.get('connector')}) did not say it was ready:\n{self.tail()}")

    def _read(self) -> None:
        """Our lines from stdout (vLLM logs there too); None once it closes."""
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK):]))
        self._answers.put(None)

    def run(self, steps: list[dict], timeout_s: float = TIMEOUT_S) -> list[dict]:
        """What each `generate` step of the batch gave."""
        if not self.alive:
            raise EngineFailed(f"vllm engine exited {self.proc.returncode}:\n{self.tail()}")
        try:
            self.proc.stdin.write(json.dumps(steps) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass        # it died meanwhile: the answer says how
        return self._answer(timeout_s, "for a batch")

    def _answer(self, timeout_s: float, waited: str):
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise EngineFailed(f"vllm engine gave no answer in {timeout_s:.0f} s {waited}; killed:\n{self.tail()}")
        if answer is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            self.kill()
            raise EngineFailed(f"vllm engine exited {self.proc.returncode}:\n{self.tail()}")
        return answer

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 120) -> None:
        """Stdin closed: the engine's loop ends and it exits as a run would; killed if it
        outlives `timeout_s`."""
        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL its process group (tp workers too)."""
        atexit.unregister(self.close)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, n: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-n:]


def pinned_threads(tp: int = 1) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` ranks over the cores this process may use: without it
    vLLM's multiprocess CPU worker reserves a core less with a KV connector than without one, so
    a comparison would time different thread counts. (With one rank the worker runs in the
    engine's own process, the uni executor: vLLM binds nothing, and both sides run torch's
    default thread count.)"""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    return "|".join(",".join(map(str, cores[(r * per) % len(cores):][:per])) for r in range(tp))


class EngineFailed(HiCacheError):
    """A vLLM engine exited without its results (a refused config, a crash)."""


def main() -> None:
    spec = json.loads(sys.argv[1])
    llm = _engine(spec)
    if "steps" in spec:
        _say(_run(llm, spec["steps"], spec.get("prompts", {})))
        return
    _say(READY)
    for line in sys.stdin:
        _say(_run(llm, json.loads(line), spec.get("prompts", {})))


def _say(answer) -> None:
    """One line on stdout, in one write: vLLM logs there too, from other threads."""
    sys.stdout.write(MARK + json.dumps(answer) + "\n")
    sys.stdout.flush()


def _engine(spec: dict):
    from vllm import LLM

    if spec.get("async_scheduling"):
        _schedule_async()
    connector, transfer = spec.get("connector", "HiCacheConnector"), None
    if connector and spec.get("extra") is not None:
        extra = spec["extra"]   # our L3 is read whenever it holds a prefix: what runs here checks or times that path
        transfer = {"kv_connector": connector, "kv_role": "kv_both",
                    "kv_connector_extra_config": {"l3_reads": "always", **extra} if connector == "HiCacheConnector"
                    and extra.get("storage", "file") != "none" else extra}
        if connector == "HiCacheConnector" and not spec.get("by_name"):
            transfer["kv_connector_module_path"] = "hicache_vllm"
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, dtype=spec.get("dtype", "bfloat16"),
               kv_cache_memory_bytes=spec.get("kv_bytes", 256 << 20), max_model_len=spec.get("max_len", 2048),
               block_size=spec.get("block_size", 32), tensor_parallel_size=spec.get("tp", 1),
               kv_transfer_config=transfer, enable_lora=bool(spec.get("lora_rank")),
               max_lora_rank=spec.get("lora_rank") or 16, enable_prompt_embeds=bool(spec.get("prompt_embeds")),
               load_format=spec.get("load_format", "auto"))
    scheduler = type(llm.llm_engine.engine_core.engine_core.scheduler).__name__ if spec.get("async_scheduling") else ""
    if spec.get("async_scheduling") and scheduler != "AsyncScheduler":
        raise EngineFailed(f"async scheduling asked for, but vLLM runs {scheduler}")
    return llm


def _schedule_async() -> None:
    """vLLM's default on a GPU, the scheduler a step ahead of the worker, which its CPU
    platform turns off ("not required on CPU"): turned back on right after that hook, so the
    CPU engine runs what users' GPUs run. The hook runs where the config is made: the engine
    must be in this process."""
    from vllm.platforms.cpu import CpuPlatform

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise EngineFailed("async scheduling on CPU needs the engine in this process (tp=1, "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    hook = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        hook(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _run(llm, steps: list[dict], prompts: dict) -> list[dict]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    results = []
    for step in steps:
        if step["op"] == "reset":
            llm.reset_prefix_cache()
            continue
        if step["op"] == "kill":
            os.kill(step["pid"], signal.SIGKILL)
            continue
        if step["op"] == "settle":
            _settle(step.get("timeout", SETTLE_S))
            continue
        batch = ([_prompt(llm, {**step, "prompt": p}, prompts) for p in step["prompts"]]
                 if step["op"] == "generate_many" else [_prompt(llm, step, prompts)])
        for prompt in batch:
            if step.get("salt"):
                prompt["cache_salt"] = step["salt"]
        sampling = SamplingParams(max_tokens=step.get("max_tokens", 1), temperature=0, logprobs=step.get("logprobs"),
                                  prompt_logprobs=step.get("prompt_logprobs"))
        lora = LoRARequest(*step["lora"]) if step.get("lora") else None
        started = time.perf_counter()
        outs = llm.generate(batch, sampling, use_tqdm=False, lora_request=lora)
        seconds = time.perf_counter() - started
        for out in outs:
            logprobs = [{str(k): v.logprob for k, v in d.items()} for d in out.outputs[0].logprobs or []]
            results.append({"seconds": seconds, "tokens": list(out.outputs[0].token_ids), "logprobs": logprobs,
                            "cached": out.num_cached_tokens, "params": out.kv_transfer_params})
    return results


def _settle(timeout_s: float) -> None:
    """Wait until every backup this process's connector issued has ended. Its worker lives in
    this process only when vLLM runs the engine in it (one rank, no multiprocessing)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise EngineFailed("settle needs the engine in this process (tp=1, VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if not has_kv_transfer_group():
        return
    worker = getattr(get_kv_transfer_group(), "worker", None)     # (None: not our connector)
    deadline = time.monotonic() + timeout_s
    while worker is not None and worker.backup_queue():
        if time.monotonic() > deadline:
            raise EngineFailed(f"backups still under way {timeout_s} s after the batch: {worker.backup_queue()} pages")
        time.sleep(0.02)


def _prompt(llm, step: dict, prompts: dict):
    """Token ids (given, or named), or seeded random prompt embeddings."""
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    if "embeds_seed" not in step:
        tokens = step["prompt"]
        return TokensPrompt(prompt_token_ids=prompts.get(tokens) if isinstance(tokens, str) else tokens)
    import torch

    hidden = llm.llm_engine.model_config.get_hidden_size()
    g = torch.Generator().manual_seed(step["embeds_seed"])
    return EmbedsPrompt(prompt_embeds=torch.randn(step["embeds_len"], hidden, generator=g).to(torch.bfloat16))


if __name__ == "__main__":
    main()
