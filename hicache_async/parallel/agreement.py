"""How ranks agree, every step: the element-wise MIN of an int64 vector, and that none diverged.

What the vector holds is the caller's business (the cache packs what it could retire; see
`hicache/ledger.py`). Every field is combined with MIN. Beside the vector each rank gives a
digest of its decisions, carried as `[d, -d]`: MIN gives `[min, -max]`, so equal halves
mean no rank diverged, and an agreement that sees otherwise raises `DivergenceError`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

NOT_READY = 2**62           # the MIN identity: "no value from this rank"


class Agreement(ABC):
    """How a rank learns, every step, what every rank can do.

    It must run every step on every rank of a world larger than one, even with nothing
    pending: a rank that skipped it would leave its peers waiting.
    """

    ranks: int = 1          # ranks agreed across; with one, an idle step may skip `agree`

    @abstractmethod
    async def agree(self, values: list[int], digest: int, step: int, world: slice | None = None) -> list[int]:
        """The MIN of every rank's `values`, once every rank's `digest` is known to be equal.

        `world` names fields that must be reduced over every rank of the world: a pipeline
        otherwise takes its first stage's MIN, and later stages adopt it. Every rank must
        pass the same `world` at a step.
        """

    async def reap(self) -> None:
        """Drop what earlier steps sent and is known to be delivered; once per step."""

    @property
    def pending_sends(self) -> int:
        return 0

    def counts(self) -> dict[str, int]:
        """Sends issued and reaped, messages received, extra world reductions: for reports."""
        return {"sent": 0, "reaped": 0, "received": 0, "world_reductions": 0}

    async def close(self) -> None:
        """Finish what peers still wait for."""


class LocalAgreement(Agreement):
    """One rank: the agreed values are the rank's own."""

    async def agree(self, values: list[int], digest: int, step: int, world: slice | None = None) -> list[int]:
        return list(values)
