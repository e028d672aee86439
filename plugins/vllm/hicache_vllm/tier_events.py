"""KV events for our tiers (medium CPU for the host tier, STORAGE for L3), so a router that
follows vLLM's events (Dynamo, llm-d) sees where a prefix lives beyond the GPU.

A router rebuilds its own hashes from each block's token ids and links blocks by vLLM's
block hashes; Dynamo's indexer drops a block whose token ids are shorter than its size. So
every `BlockStored` is what vLLM's own GPU events are: vLLM's block hashes, the blocks'
token ids, size, parent, LoRA id and extra keys. A page is announced once per tier and
withdrawn (`BlockRemoved`) when it leaves. Only what later events need is kept:

- a page in the host tier keeps its whole `Block`, for the STORAGE event its backup sends
  when it completes; so does a page that left the tier, for a backup still under way
  (write_back stores pages as they leave), at most `host_pages` of them, the oldest dropped;
- a page announced in L3 keeps only vLLM's hash of it, for its removal: at most `l3_pages`
  (the scheduler's memory of L3), the oldest forgotten.
A page no event of ours can name with its tokens (read from an L3 that another process
wrote, for a request gone since) is not announced: a router would drop the event anyway.
Only a request with vLLM's block hashes (one from vLLM) is announced, so vLLM is imported
where an event is made: the scheduler side runs without it (a test's requests have none).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .settings import DEFAULT_HOST_PAGES

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent

MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"      # vLLM's names of the host tier's and L3's medium
L3_PAGES = 1 << 20      # pages announced in L3 remembered, at most: the scheduler's KNOWN_PAGES


@dataclass(frozen=True, slots=True)
class Block:
    """One page as vLLM's events name it; token ids 4 bytes each."""

    hash: object            # vLLM's ExternalBlockHash (an int by default, else bytes)
    parent: object | None
    tokens: array
    lora_id: int | None
    lora_name: str | None
    extra: tuple | None     # vLLM's untagged extra keys of this block
    session_id: str | None  # the session whose request stored it


class TierEvents:
    def __init__(self, page_size: int, host_pages: int = DEFAULT_HOST_PAGES, l3_pages: int = L3_PAGES) -> None:
        self.page_size, self.host_pages, self.l3_pages = page_size, host_pages, l3_pages
        self.pending: list[KVCacheEvent] = []
        self._host: dict[str, Block] = {}                       # our page hash -> its block
        self._left: OrderedDict[str, Block] = OrderedDict()     # left the host tier, oldest first
        self._l3: OrderedDict[str, object] = OrderedDict()      # announced in L3 -> vLLM's hash

    def stored(self, request, pages: list[int], ours: list[str], medium: str) -> None:
        """The request's `pages` (indices; `ours` are its page hashes) are now held in `medium`."""
        named = len(getattr(request, "block_hashes", ()) or ())     # vLLM hashes full blocks only
        self._announce([(ours[p], _block(request, p, self.page_size)) for p in pages if p < named], medium)

    def stored_hashes(self, hashes: list[str], medium: str, request=None, ours: list[str] = ()) -> None:
        """Pages known by our hash are now held in `medium` (a backup or a prefetch finished);
        `request`, whose page hashes are `ours`, names those this object has not seen."""
        at = {h: p for p, h in enumerate(ours)} if request is not None else {}
        named = []
        for h in hashes:
            block = self._host.get(h) or self._left.get(h)
            if block is None and h in at and at[h] < len(request.block_hashes):
                block = _block(request, at[h], self.page_size)
            if block is not None:
                named.append((h, block))
        self._announce(named, medium)

    def removed(self, hashes: list[str], medium: str) -> None:
        """Pages that left `medium`: withdrawn, those that were announced."""
        gone = []
        for h in hashes:
            if medium == MEDIUM_CPU and h in self._host:
                block = self._left[h] = self._host.pop(h)
                gone.append(block.hash)
                if len(self._left) > self.host_pages:
                    self._left.popitem(last=False)
            elif medium == MEDIUM_STORAGE and h in self._l3:
                gone.append(self._l3.pop(h))
        if gone:
            from vllm.distributed.kv_events import BlockRemoved

            self.pending.append(BlockRemoved(block_hashes=gone, medium=medium))

    def take(self) -> list[KVCacheEvent]:
        out, self.pending = self.pending, []
        return out

    def _announce(self, pages: list[tuple[str, Block]], medium: str) -> None:
        """A `BlockStored` for each of `pages` not yet announced in `medium`."""
        if not pages:
            return
        from vllm.distributed.kv_events import BlockStored

        for h, block in pages:
            if medium == MEDIUM_CPU:
                if h in self._host:
                    continue
                self._host[h] = block
                self._left.pop(h, None)
            elif medium == MEDIUM_STORAGE:
                if h in self._l3:
                    continue
                self._l3[h] = block.hash
                if len(self._l3) > self.l3_pages:
                    self._l3.popitem(last=False)
            self.pending.append(BlockStored(
                block_hashes=[block.hash], parent_block_hash=block.parent, token_ids=block.tokens.tolist(),
                block_size=self.page_size, lora_id=block.lora_id, medium=medium, lora_name=block.lora_name,
                extra_keys=None if block.extra is None else [block.extra], group_idx=0,
                session_id=block.session_id))


def _block(request, page: int, page_size: int) -> Block:
    """Page `page` of a vLLM request, as its GPU events would name the block."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes, start = request.block_hashes, page * page_size
    lora = getattr(request, "lora_request", None)
    return Block(hash=maybe_convert_block_hash(hashes[page]),
                 parent=maybe_convert_block_hash(hashes[page - 1]) if page else None,
                 tokens=array("i", request.all_token_ids[start:start + page_size]),
                 lora_id=lora.adapter_id if lora is not None else None,
                 lora_name=lora.name if lora is not None else None,
                 extra=_extra_keys(request, start, start + page_size),
                 session_id=getattr(request, "session_id", None))


def _extra_keys(request, start: int, end: int) -> tuple | None:
    """vLLM's own extra keys of a block (LoRA, multimodal items, cache salt, prompt embeddings),
    untagged as its events carry them; a stand-in for vLLM's Request (a test's) has none."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys
    from vllm.v1.request import Request

    if not isinstance(request, Request):
        return None
    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    return to_event_extra_keys([keys])[0]
