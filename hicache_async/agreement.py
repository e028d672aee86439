"""The one packed int64 message that ranks agree on every step.

Layout: `[write, load, backup, prefetch, prefetch_pages x PREFETCH_SLOTS, digest, -digest]`,
built as a Python list and turned into one int64 tensor only where it crosses ranks.
Every field is combined with MIN, so one reduction gives each queue the count that every
rank can retire, the pages every rank fetched, and `[min, -max]` of the decision digests:
equal halves mean no rank diverged.
"""
from __future__ import annotations

PREFETCH_SLOTS = 4
WRITE, LOAD, BACKUP, PREFETCH = range(4)
PAGES = 4
DIGEST = PAGES + PREFETCH_SLOTS
NOT_READY = 2**62


def pack(counts: tuple[int, int, int, int], prefetch_pages: list[int], digest: int) -> list[int]:
    slots = list(prefetch_pages) + [NOT_READY] * (PREFETCH_SLOTS - len(prefetch_pages))
    return [*counts, *slots, digest, -digest]


class LocalAgreement:
    """One rank: the agreed message is the rank's own."""

    pending_sends = 0

    async def agree(self, msg: list[int], step: int, prefetch_pending: bool = False) -> list[int]:
        return msg

    def reap(self) -> None:
        pass

    def close(self) -> None:
        pass
