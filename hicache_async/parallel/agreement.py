"""The one packed int64 message that ranks agree on every step.

Layout: `[write, load, backup, prefetch, prefetch_pages x PREFETCH_SLOTS, l3_kbps, digest,
-digest]`, built as a Python list and turned into one int64 tensor only where it crosses ranks.
Every field is combined with MIN, so one reduction gives each queue the count that every
rank can retire, the pages every rank fetched, the slowest L3 throughput any rank just saw
(NOT_READY: none), and `[min, -max]` of the decision digests: equal halves mean no rank
diverged.
"""
from __future__ import annotations

PREFETCH_SLOTS = 4
WRITE, LOAD, BACKUP, PREFETCH = range(4)
PAGES = 4
L3_KBPS = PAGES + PREFETCH_SLOTS
DIGEST = L3_KBPS + 1
NOT_READY = 2**62


def pack(counts: tuple[int, int, int, int], prefetch_pages: list[int], digest: int,
         l3_kbps: int = NOT_READY) -> list[int]:
    slots = list(prefetch_pages) + [NOT_READY] * (PREFETCH_SLOTS - len(prefetch_pages))
    return [*counts, *slots, l3_kbps, digest, -digest]


class LocalAgreement:
    """One rank: the agreed message is the rank's own; nothing is sent, so nothing to reap."""

    pending_sends = 0

    def counts(self) -> dict[str, int]:
        return {"sent": 0, "reaped": 0, "received": 0, "world_reductions": 0}

    async def agree(self, msg: list[int], step: int, l3_pending: bool = False) -> list[int]:
        return msg

    async def reap(self) -> None:
        pass

    async def close(self) -> None:
        pass
