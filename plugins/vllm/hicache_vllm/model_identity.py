"""The model part of every stored object's namespace, and what we refuse to cache at all.

A model's name says little about its KV: new weights saved over the old folder, another
quantization, RoPE scaling from `hf_overrides`, another revision or KV-cache dtype each
change the bytes under the same name. So the namespace names the checkpoint by a fingerprint
of its files (`hicache_async.fingerprint`) and the settings that change what it computes.
What decides KV bytes that a key cannot name yet stops the engine at start-up, one line.
"""
from __future__ import annotations

import structlog

from hicache_async.errors import UsageError
from hicache_async.fingerprint import checkpoint_fingerprint, local_checkpoint

log = structlog.get_logger(__name__)


def refuse_unkeyable(vllm_config) -> None:
    """Stop start-up on a model whose KV our keys cannot name."""
    model = vllm_config.model_config
    if model.is_hybrid or model.is_attention_free:
        raise UsageError(f"HiCacheConnector: {model.model} keeps recurrent (Mamba) state beside its KV pages; "
                         f"that state cannot be cached by page")


def model_identity(vllm_config, model_id: str | None) -> str:
    """`name@fingerprint`: the name (ours, or vLLM's) and a fingerprint of the checkpoint and
    of every setting that changes its KV. A checkpoint that cannot be read stops start-up,
    unless the operator names the model (`model_id`), vouching for it."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    overrides = model.hf_overrides
    settings = {
        "quantization": model.quantization, "revision": model.revision, "code_revision": model.code_revision,
        "hf_overrides": overrides if isinstance(overrides, dict) else getattr(overrides, "__qualname__", "callable"),
        "rope": getattr(model.hf_config, "rope_parameters", None) or getattr(model.hf_config, "rope_scaling", None),
        "dtype": str(model.dtype), "cache_dtype": cache.cache_dtype,
    }
    try:
        local = local_checkpoint(model.model_weights or model.model, model.revision)
        fingerprint = checkpoint_fingerprint(local, settings)
    except UsageError as exc:
        if not model_id:
            raise UsageError(f"HiCacheConnector: {exc}; set kv_connector_extra_config model_id to vouch for it")
        log.warning("hicache: checkpoint not fingerprinted; keys trust model_id", model_id=model_id, reason=str(exc))
        return model_id
    identity = f"{model_id or model.model}@{fingerprint}"
    log.info("hicache: model fingerprint", model=model.model, fingerprint=fingerprint, settings=settings)
    return identity
