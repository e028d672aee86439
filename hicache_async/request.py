"""A request as the engine sees it. A KV plugin sets `pages`, `cached` and `kv_len` when it
admits one and keeps anything else it needs in its own state, keyed by `id`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Request:
    id: int
    prompt: list[int]
    max_new: int
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)   # device pages for every position it will hold
    cached: int = 0                                    # prompt tokens whose KV came from a cache tier
    kv_len: int = 0                                    # positions whose KV is in `pages`
    tag: Any = None                                    # the workload's label (conversation, turn)
    cache_salt: str | None = None                      # the tenant (vLLM's name): no page is shared across salts

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose KV the request holds: prompt plus all outputs but the last."""
        return (self.prompt + self.output)[: self.kv_len]

    def pages_needed(self, page_size: int) -> int:
        return pages_needed(len(self.prompt), self.max_new, page_size)


def pages_needed(prompt_len: int, max_new: int, page_size: int) -> int:
    """Device pages a request holds at its longest: its prompt and all outputs but the last."""
    return -(-(prompt_len + max_new - 1) // page_size)
