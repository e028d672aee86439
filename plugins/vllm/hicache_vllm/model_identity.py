"""The model part of every stored object's namespace, and what we refuse to cache at all.

A model's name says little about its KV: new weights saved over the old folder, another
quantization, RoPE scaling from `hf_overrides`, another revision, KV-cache dtype or load
format (`dummy` gives random weights over a real folder) each change the bytes under the same
name. So the namespace names the checkpoint by a fingerprint of the files vLLM loads (for a
hub id, its snapshot under `--download-dir` when one is set) and the settings that change what
it computes. What decides KV bytes that a key cannot name yet stops the engine at start-up,
one line.
"""
from __future__ import annotations

import structlog

from hicache_async.errors import UsageError
from hicache_async.fingerprint import checkpoint_fingerprint, local_checkpoint, settings_fingerprint

log = structlog.get_logger(__name__)


def refuse_unkeyable(vllm_config) -> None:
    """Stop start-up on a model whose KV our keys cannot name, or whose ranks we do not count.

    A speculative draft that keeps KV of its own (EAGLE, MTP, a draft model) is refused: the
    draft's KV at a page's last token mixes in the token after it (vLLM drops such trailing
    blocks from its own prefix cache), and its layers may sit in a KV cache group of their own,
    with block ids our plans do not carry. Drafts without KV (n-gram, suffix, Medusa) leave the
    model's KV as it is. A hybrid's state groups are judged group by group (`kv_groups.py`); a
    model of state alone, with no attention to key a hit by, is refused."""
    model, parallel, spec = vllm_config.model_config, vllm_config.parallel_config, vllm_config.speculative_config
    if model.is_attention_free:
        raise UsageError(f"HiCacheConnector: {model.model} keeps recurrent (Mamba or linear-attention) state "
                         f"and no attention KV; caching a model of state alone is not supported yet")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise UsageError(f"HiCacheConnector: {name}={getattr(parallel, name)} is not supported: "
                             f"a page's KV would be split across ranks it does not count")
    if spec is not None and spec.uses_draft_kv_cache():
        raise UsageError(f"HiCacheConnector: speculative method {spec.method!r} keeps draft KV whose last "
                         f"page depends on the next token; not supported (n-gram or suffix decoding is)")


def model_identity(vllm_config, model_id: str | None) -> str:
    """`name@fingerprint`: the name (ours, or vLLM's) and a fingerprint of the checkpoint and
    of every setting that changes its KV. A checkpoint that cannot be read stops start-up,
    unless the operator names the model (`model_id`), vouching for its weights: then the
    settings alone are fingerprinted after that name."""
    model, cache, load = vllm_config.model_config, vllm_config.cache_config, vllm_config.load_config
    overrides = model.hf_overrides
    settings = {
        "quantization": model.quantization, "revision": model.revision, "code_revision": model.code_revision,
        "hf_overrides": overrides if isinstance(overrides, dict) else getattr(overrides, "__qualname__", "callable"),
        "rope": getattr(model.hf_config, "rope_parameters", None) or getattr(model.hf_config, "rope_scaling", None),
        "dtype": str(model.dtype), "cache_dtype": cache.cache_dtype, "load_format": str(load.load_format),
    }
    try:
        local = local_checkpoint(model.model_weights or model.model, model.revision, load.download_dir)
        fingerprint = checkpoint_fingerprint(local, settings)
    except UsageError as exc:
        if not model_id:
            raise UsageError(f"HiCacheConnector: {exc}; set kv_connector_extra_config model_id to vouch for it")
        log.warning("hicache: checkpoint not fingerprinted; keys trust model_id", model_id=model_id, reason=str(exc))
        return f"{model_id}@{settings_fingerprint(settings)}"
    identity = f"{model_id or model.model}@{fingerprint}"
    log.info("hicache: model fingerprint", model=model.model, fingerprint=fingerprint, settings=settings)
    return identity
