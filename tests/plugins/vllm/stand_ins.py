"""vLLM's request as our hooks read it, for tests that drive the scheduler and worker sides
without vLLM (a GPU machine has torch, not vLLM)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: object = None
    prompt_embeds: object = None
    mm_features: list = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)
