"""The model's name in the namespace: a fingerprint of what decides a page's bytes.

SGLang's page hashes name the tokens (and a request's LoRA adapter and cache salt), never the
model, so our namespace must: the checkpoint's files, and the settings that change what it
computes from them (dtype, KV-cache dtype and its scales, quantization, json overrides with
RoPE scaling, revision, load format). They come from the server args the scheduler process
published; outside a server (no args published) only the checkpoint named by SGLang's storage
config is fingerprinted. A path that cannot be fingerprinted stops the start, unless the
operator names the model (`model_id`) and so vouches for it.

LoRA: SGLang folds a request's `lora_id` into its page hashes (`Req.__init__` appends it to
`extra_key`, which seeds the storage hash chain), but a `--lora-paths` adapter's id is a digest
of its name and path, not its weights: one retrained in place keeps its id. So each of those
adapters' bytes goes into the namespace too (an adapter loaded at run time gets a random id
and cannot meet another's pages).
"""
from __future__ import annotations

import hashlib
import logging

from hicache_async.errors import UsageError
from hicache_async.fingerprint import adapter_fingerprint, checkpoint_fingerprint, local_checkpoint

log = logging.getLogger(__name__)

SETTINGS = ("dtype", "kv_cache_dtype", "quantization", "quantization_param_path", "modelopt_quant",
            "json_model_override_args", "revision", "load_format")
"""SGLang's model arguments that change the KV a checkpoint computes."""


def model_id(config, named: str | None) -> str:
    """The namespace's model id: the checkpoint's fingerprint (after `named`, the operator's
    name, if given), with the startup adapters' when LoRA is on; logged once. A checkpoint
    that cannot be read is a UsageError naming it, unless `named` vouches for it alone."""
    model, lora = _published("model"), _published("lora")
    path = model.model_path if model is not None else config.model_name
    settings = {name: getattr(model, name, None) for name in SETTINGS} if model is not None else {}
    source = f"{path} with {settings}" if model is not None else f"{path} (no server args published)"
    try:
        local = local_checkpoint(path, settings.get("revision"), getattr(model, "download_dir", None))
        base = "checkpoint-" + checkpoint_fingerprint(local, settings)
    except UsageError as exc:
        if not named:
            raise UsageError(f"hicache-async: {exc}; pass model_id in the extra config to name it yourself") from None
        base, source = None, f"named by model_id; {exc}"
    base = "@".join(part for part in (named, base) if part)
    adapters = _adapters(lora)
    ident = base + (f"+lora-{adapters}" if adapters else "")
    log.info("hicache-async: model namespace %s (%s%s)", ident, source,
             "; startup LoRA adapters by their bytes" if adapters else "")
    return ident


def _adapters(lora) -> str | None:
    """One digest of every `--lora-paths` adapter's id and bytes; None without LoRA."""
    if lora is None or not lora.enable_lora or not lora.lora_paths:
        return None
    h = hashlib.sha256(b"hicache-async sglang adapters v1\0")
    for ref in sorted(lora.lora_paths, key=lambda ref: ref.lora_id):
        try:
            digest = adapter_fingerprint(local_checkpoint(ref.lora_path))
        except UsageError as exc:
            raise UsageError(f"hicache-async: LoRA {ref.lora_name!r}: {exc}") from None
        h.update(f"{ref.lora_id}\0{digest}\0".encode())
    return h.hexdigest()[:16]


def _published(name: str):
    """SGLang's resolved config namespace `name`, or None where no server args are published."""
    from sglang.srt.runtime_context import get_context

    try:
        return get_context().config_bag(name)
    except ValueError:
        return None
