"""KV events for our tiers (medium CPU for the host tier, STORAGE for L3), so a router that
follows vLLM's events (llm-d, Dynamo) sees where a prefix lives beyond the GPU.

Events name blocks by vLLM's own block hash, as its GPU events do, so a router matches them;
a page whose vLLM hash this process never saw (read from L3 that another wrote) goes by ours.
"""
from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

KNOWN_HASHES = 1 << 16   # vLLM hashes remembered for removal events, at most


class TierEvents:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pending: list[KVCacheEvent] = []
        self._vllm: dict[str, object] = {}    # our page hash -> vLLM's, for later events

    def _external(self, page_hash: str):
        known = self._vllm.get(page_hash)
        return known if known is not None else bytes.fromhex(page_hash)

    def stored(self, request, pages: list[int], ours: list[str], medium: str) -> None:
        """The request's `pages` (indices; `ours` are its page hashes) are now held in `medium`."""
        hashes = list(getattr(request, "block_hashes", ()) or ())
        if len(hashes) < max(pages) + 1:
            return
        for p in pages:
            if len(self._vllm) < KNOWN_HASHES:
                self._vllm[ours[p]] = maybe_convert_block_hash(hashes[p])
            start = p * self.page_size
            self.pending.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(hashes[p])],
                parent_block_hash=maybe_convert_block_hash(hashes[p - 1]) if p else None,
                token_ids=list(request.all_token_ids[start:start + self.page_size]), block_size=self.page_size,
                lora_id=None, medium=medium, lora_name=None))

    def stored_hashes(self, hashes: list[str], medium: str) -> None:
        """Pages known only by our hash are now held in `medium` (no token ids at hand)."""
        if hashes:
            self.pending.append(BlockStored(block_hashes=[self._external(h) for h in hashes],
                                            parent_block_hash=None, token_ids=[], block_size=self.page_size,
                                            lora_id=None, medium=medium, lora_name=None))

    def removed(self, hashes: list[str], medium: str) -> None:
        if hashes:
            self.pending.append(BlockRemoved(block_hashes=[self._external(h) for h in hashes], medium=medium))

    def take(self) -> list[KVCacheEvent]:
        out, self.pending = self.pending, []
        return out
