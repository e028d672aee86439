"""What names a vLLM request's pages beyond their token ids: everything else that decides
their KV. vLLM's own prefix cache mixes the same things into its block hashes; ours must too,
or a page computed under one adapter (or from other embeddings) is served to another.

- `cache_salt` and the LoRA adapter start the chain, so they reach every page. An adapter is
  named by a digest of the files vLLM loads from it (`adapter_config.json` and its first
  weights file), not its name or path: a fine-tune saved again at the same path keeps both.
  vLLM loads an adapter once per `lora_int_id` (unless `load_inplace`), so the digest is taken
  once per id too, and matches the weights the workers hold; with `load_inplace`, once per
  version of those files. Digests run on a thread of their own: the scheduler's thread asks
  again next step rather than read an adapter's megabytes.
- Each page's slice of prompt embeddings, and the multimodal items that fall in it (their
  content hash and offset), are hashed after the page's tokens, as vLLM's own extra keys name
  them: a request with embeddings has only placeholder token ids.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from hicache_async.fingerprint import adapter_fingerprint, local_checkpoint
from hicache_async.keys import page_hashes

log = structlog.get_logger(__name__)
CHAIN_KEYS = ("lora", "cache_salt")     # vLLM's extra keys that the chain's start covers
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")   # vLLM takes the first


class RequestKeys:
    """Page hashes of vLLM requests; one per scheduler, remembering adapter digests."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._adapters: dict[tuple, Future] = {}
        self._digests = ThreadPoolExecutor(1, thread_name_prefix="hicache-adapter")

    def extend(self, request, hashes: list[str]) -> bool | None:
        """Append the hashes of the request's full pages not yet in `hashes`. False when the
        request cannot be keyed (its adapter cannot be read, or anything else failed): it must
        neither hit nor be saved, and is logged here once; the caller does not ask again.
        None while its adapter's digest is still running: ask again next step."""
        try:
            tokens = request.all_token_ids
            have, full = len(hashes), len(tokens) // self.page_size
            lora = None if have else getattr(request, "lora_request", None)
            digest = self._adapter(lora) if lora is not None else None     # started before a page is full
            if full <= have:
                return True
            if digest is not None and not digest.done():
                return None
            adapter = self._result(digest) if digest is not None else None
            prior = hashes[-1] if have else None
            extras = [self.page_extra(request, p) for p in range(have, full)]
            start = {} if have else {"salt": request.cache_salt, "adapter": adapter}
            hashes += page_hashes(tokens[have * self.page_size:full * self.page_size], self.page_size, prior,
                                  extras=extras, **start)
            return True
        except Exception as exc:    # noqa: BLE001 - a request we cannot key is recomputed, never a stopped engine
            log.warning("hicache: request not cached", request=getattr(request, "request_id", None),
                        reason=f"{type(exc).__name__}: {exc}")
            return False

    def _adapter(self, lora) -> Future:
        """The digest of the adapter's loaded files, started at its first sight."""
        version = (lora.lora_int_id,) if not lora.load_inplace else (lora.lora_int_id, *_stamps(lora.lora_path))
        digest = self._adapters.get(version)
        if digest is None:
            digest = self._adapters[version] = self._digests.submit(_adapter_digest, lora)
        return digest

    def _result(self, digest: Future) -> str:
        """The digest's result; a failed one is forgotten by the request that meets it, so the
        next request starts another."""
        try:
            return digest.result()
        except Exception:
            for version in [v for v, d in self._adapters.items() if d is digest]:
                del self._adapters[version]
            raise

    def page_extra(self, request, page: int) -> bytes:
        """Page `page`'s bytes beyond its token ids, as vLLM's own block hash names them: its
        multimodal items (content hash, offset) and its prompt embeddings' digest, which vLLM
        has cached on the request while hashing its blocks. Its LoRA and salt keys are left
        out: the chain's start names those (the adapter by its bytes). A request with neither
        has nothing more, and needs no vLLM (the scheduler side runs without it)."""
        if not request.mm_features and request.prompt_embeds is None:
            return b""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        first = page * self.page_size
        keys, _ = generate_block_hash_extra_keys(request, first, first + self.page_size, 0)
        ours = [k for k in keys or () if k[0] not in CHAIN_KEYS]
        return hashlib.sha256(repr(ours).encode()).digest() if ours else b""


def _adapter_folder(path: str) -> str:
    """The local folder vLLM loads an adapter from (`get_adapter_absolute_path`), without
    downloading: a hub adapter vLLM has not fetched yet is not fingerprinted."""
    path = os.path.expanduser(path)
    return os.path.abspath(path) if os.path.exists(path) else local_checkpoint(path)


def _loaded(folder: str) -> list[str]:
    """The files vLLM reads from an adapter folder: its config and its first weights file."""
    weights = next((w for w in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(folder, w))), None)
    return [ADAPTER_CONFIG, weights] if weights else [ADAPTER_CONFIG]


def _stamps(path: str) -> tuple:
    """What names one version of an adapter's loaded files without reading them."""
    folder = _adapter_folder(path)
    return tuple((name, st.st_size, st.st_mtime_ns, st.st_ino)
                 for name in _loaded(folder) for st in [os.stat(os.path.join(folder, name))])


def _adapter_digest(lora) -> str:
    digest = adapter_fingerprint(folder := _adapter_folder(lora.lora_path), _loaded(folder))
    log.info("hicache: LoRA adapter fingerprinted", lora=lora.lora_name, fingerprint=digest)
    return digest


def reads_external(request) -> bool:
    """Whether the request may take KV from our tiers: not when it asks for prompt logprobs
    (they need the prompt computed) or to skip reading the prefix cache."""
    if getattr(request, "skip_reading_prefix_cache", False):
        return False
    params = getattr(request, "sampling_params", None)
    return getattr(params, "prompt_logprobs", None) is None
