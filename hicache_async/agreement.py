"""The one packed int64 message that ranks agree on every step.

Layout: `[write, load, backup, prefetch, prefetch_pages x PREFETCH_SLOTS, digest, -digest]`.
Every field is combined with MIN, so one reduction gives each queue the count that every
rank can retire, the pages every rank fetched, and `[min, -max]` of the decision digests:
equal halves mean no rank diverged.
"""
from __future__ import annotations

import torch

PREFETCH_SLOTS = 4
WRITE, LOAD, BACKUP, PREFETCH = range(4)
PAGES = 4
DIGEST = PAGES + PREFETCH_SLOTS
NOT_READY = 2**62


def pack(counts: tuple[int, int, int, int], prefetch_pages: list[int], digest: int) -> torch.Tensor:
    slots = list(prefetch_pages) + [NOT_READY] * (PREFETCH_SLOTS - len(prefetch_pages))
    return torch.tensor([*counts, *slots, digest, -digest], dtype=torch.int64)


def fold(into: torch.Tensor, own: torch.Tensor, fields: slice) -> None:
    """MIN-combine `own` into `into` over `fields` (a stage folding its own view in)."""
    into[fields] = torch.minimum(into[fields], own[fields])


class LocalAgreement:
    """One rank: the agreed message is the rank's own."""

    pending_sends = 0

    async def agree(self, msg: torch.Tensor, step: int, prefetch_pending: bool = False) -> torch.Tensor:
        return msg

    def reap(self) -> None:
        pass

    def close(self) -> None:
        pass
