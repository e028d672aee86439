"""What names a vLLM request's pages beyond their token ids: everything else that decides
their KV. vLLM's own prefix cache mixes the same things into its block hashes; ours must too,
or a page computed under one adapter (or from other embeddings) is served to another.

- `cache_salt` and the LoRA adapter start the chain, so they reach every page. An adapter is
  named by a digest of its files, not its name or path: a fine-tune saved again at the same
  path keeps both. vLLM loads an adapter once per `lora_int_id` (unless `load_inplace`), so
  the digest is taken once per id too, and matches the weights the workers hold.
- Each page's slice of prompt embeddings, and the multimodal items that fall in it (their
  content hash and offset), are hashed after the page's tokens: a request with embeddings has
  only placeholder token ids.
"""
from __future__ import annotations

import hashlib

import structlog
import torch

from hicache_async.errors import UsageError
from hicache_async.fingerprint import adapter_fingerprint
from hicache_async.keys import page_hashes

log = structlog.get_logger(__name__)


class RequestKeys:
    """Page hashes of vLLM requests; one per scheduler, remembering adapter digests."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._adapters: dict[int, str] = {}

    def adapter(self, request) -> str | None:
        """The digest of the request's LoRA weights; None without an adapter. Raises a
        UsageError naming the adapter when its weights cannot be read."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return None
        known = self._adapters.get(lora.lora_int_id)
        if known is None or lora.load_inplace:
            known = self._adapters[lora.lora_int_id] = adapter_fingerprint(lora.lora_path)
            log.info("hicache: LoRA adapter fingerprinted", lora=lora.lora_name, fingerprint=known)
        return known

    def extend(self, request, hashes: list[str]) -> bool:
        """Append the hashes of the request's full pages not yet in `hashes`; False when
        the request cannot be keyed (its adapter cannot be read): it must neither hit nor
        be saved."""
        tokens = request.all_token_ids
        have, full = len(hashes), len(tokens) // self.page_size
        if full <= have:
            return True
        try:
            start = {} if have else {"salt": request.cache_salt, "adapter": self.adapter(request)}
        except UsageError as exc:
            log.warning("hicache: request not cached", request=request.request_id, reason=str(exc))
            return False
        prior = hashes[-1] if have else None
        extras = [self.page_extra(request, p) for p in range(have, full)]
        hashes += page_hashes(tokens[have * self.page_size:full * self.page_size], self.page_size, prior,
                              extras=extras, **start)
        return True

    def page_extra(self, request, page: int) -> bytes:
        """Page `page`'s bytes beyond its token ids: its prompt embeddings and multimodal items."""
        first, end = page * self.page_size, (page + 1) * self.page_size
        h = None
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None and first < embeds.shape[0]:
            h = hashlib.sha256(b"embeds\0")
            part = embeds[first:end].detach().cpu().contiguous()
            h.update(f"{part.dtype}{tuple(part.shape)}".encode())
            h.update(part.view(-1).view(torch.uint8).numpy().tobytes())
            mask = getattr(request, "prompt_is_token_ids", None)
            if mask is not None:
                h.update(bytes(bool(m) for m in mask[first:end]))
        for feature in getattr(request, "mm_features", None) or ():
            pos = feature.mm_position
            if pos.offset < end and first < pos.offset + pos.length:
                h = h or hashlib.sha256(b"mm\0")
                h.update(f"{feature.modality}\0{feature.identifier}\0{pos.offset}\0{pos.length}\0".encode())
        return h.digest() if h is not None else b""


def reads_external(request) -> bool:
    """Whether the request may take KV from our tiers: not when it asks for prompt logprobs
    (they need the prompt computed) or to skip reading the prefix cache."""
    if getattr(request, "skip_reading_prefix_cache", False):
        return False
    params = getattr(request, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is None
