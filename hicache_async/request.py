"""A request as the scheduler and the cache plugins both see it."""
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
    loads: list[Any] = field(default_factory=list)    # load ops its next forward must wait on
    lock: Any = None                                   # the cache node its prefix pins
    prefetch: Any = None                               # the L3 prefetch it waits for, if any
    prefetched: bool = False
    tag: Any = None                                    # the workload's label (conversation, turn)

    @property
    def kv_tokens(self) -> list[int]:
        """Tokens whose KV the request holds: prompt plus all outputs but the last."""
        return (self.prompt + self.output)[: self.kv_len]

    def pages_needed(self, page_size: int) -> int:
        return -(-(len(self.prompt) + self.max_new - 1) // page_size)
