"""What names a vLLM request's pages beyond their token ids: everything else that decides
their KV. vLLM's own prefix cache mixes the same things into its block hashes; ours must too,
or a page computed under one adapter (or from other embeddings) is served to another.

- `cache_salt` and the LoRA adapter start the chain, so they reach every page. An adapter is
  named by a digest of its files, not its name or path: a fine-tune saved again at the same
  path keeps both. vLLM loads an adapter once per `lora_int_id` (unless `load_inplace`), so
  the digest is taken once per id too, and matches the weights the workers hold.
- Each page's slice of prompt embeddings, and the multimodal items that fall in it (their
  content hash and offset), are hashed after the page's tokens, as vLLM's own extra keys name
  them: a request with embeddings has only placeholder token ids.
"""
from __future__ import annotations

import hashlib

import structlog
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from hicache_async.errors import UsageError
from hicache_async.fingerprint import adapter_fingerprint
from hicache_async.keys import page_hashes

log = structlog.get_logger(__name__)
CHAIN_KEYS = ("lora", "cache_salt")     # vLLM's extra keys that the chain's start covers


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
        """Page `page`'s bytes beyond its token ids, as vLLM's own block hash names them: its
        multimodal items (content hash, offset) and its prompt embeddings' digest, which vLLM
        has cached on the request while hashing its blocks. Its LoRA and salt keys are left
        out: the chain's start names those (the adapter by its bytes)."""
        first = page * self.page_size
        keys, _ = generate_block_hash_extra_keys(request, first, first + self.page_size, 0)
        ours = [k for k in keys or () if k[0] not in CHAIN_KEYS]
        return hashlib.sha256(repr(ours).encode()).digest() if ours else b""


def reads_external(request) -> bool:
    """Whether the request may take KV from our tiers: not when it asks for prompt logprobs
    (they need the prompt computed) or to skip reading the prefix cache."""
    if getattr(request, "skip_reading_prefix_cache", False):
        return False
    params = getattr(request, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is None
