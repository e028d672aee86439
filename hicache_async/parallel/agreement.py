"""The message ranks agree on every step, and the protocol a rank reaches it through.

A `StepMessage` is what one rank could retire now. It crosses ranks as one int64 tensor,
`[writes, loads, backups, prefetches, prefetch_pages x PREFETCH_SLOTS, l3_kbps, digest,
-digest]`, and every field is combined with MIN, so one reduction gives each queue the count
every rank can retire, the pages every rank fetched, the slowest L3 throughput any rank just
saw (NOT_READY: none), and `[min, -max]` of the decision digests: equal halves mean no rank
diverged. Only this module knows the layout.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass

PREFETCH_SLOTS = 4          # leading prefetches one step can retire
NOT_READY = 2**62           # the MIN identity: "no value from this rank"
_PAGES = 4                  # where the prefetch page slots start
_STORAGE = slice(2, _PAGES + PREFETCH_SLOTS + 1)   # backups, prefetches, their pages, l3_kbps


@dataclass(frozen=True)
class StepMessage:
    writes: int = 0
    loads: int = 0
    backups: int = 0
    prefetches: int = 0
    prefetch_pages: tuple[int, ...] = ()    # pages each of the leading `prefetches` fetched
    l3_kbps: int = NOT_READY
    digest: int = 0                         # after a reduction: the least digest of any rank
    digest_max: int | None = None           # and the greatest; None: same as `digest`

    def __post_init__(self) -> None:
        if len(self.prefetch_pages) != self.prefetches or self.prefetches > PREFETCH_SLOTS:
            raise ValueError(f"{self.prefetches} prefetches with pages {self.prefetch_pages}: "
                             f"expected one page count each, at most {PREFETCH_SLOTS}")
        if self.digest_max is None:
            object.__setattr__(self, "digest_max", self.digest)

    @property
    def diverged(self) -> bool:
        """Whether the ranks folded in had different decision digests."""
        return self.digest != self.digest_max

    def pack(self) -> list[int]:
        slots = [*self.prefetch_pages, *[NOT_READY] * (PREFETCH_SLOTS - self.prefetches)]
        return [self.writes, self.loads, self.backups, self.prefetches, *slots, self.l3_kbps,
                self.digest, -self.digest_max]

    @classmethod
    def unpack(cls, values: list[int]) -> StepMessage:
        """A reduced message; slots past the agreed prefetch count are dropped (some rank had
        no such prefetch, so their MIN means nothing)."""
        writes, loads, backups, prefetches = values[:_PAGES]
        pages = tuple(values[_PAGES: _PAGES + prefetches])
        return cls(writes, loads, backups, prefetches, pages, values[_STORAGE.stop - 1],
                   values[-2], -values[-1])

    def storage(self) -> list[int]:
        """The fields that concern L3 ops, which a pipeline reduces over the whole world."""
        return self.pack()[_STORAGE]

    def with_storage(self, values: list[int]) -> StepMessage:
        packed = self.pack()
        packed[_STORAGE] = values
        return StepMessage.unpack(packed)

    def fold_digest(self, digest: int) -> StepMessage:
        """This message with one more rank's digest folded in, as a reduction would."""
        return dataclasses.replace(self, digest=min(self.digest, digest),
                                   digest_max=max(self.digest_max, digest))


class Agreement(ABC):
    """How a rank learns, every step, what every rank can retire.

    It must run every step on every rank of a world larger than one, even with nothing
    pending: a rank that skipped it would leave its peers waiting.
    """

    ranks: int = 1          # ranks agreed across; with one, an idle step may skip `agree`

    @abstractmethod
    async def agree(self, msg: StepMessage, step: int, l3_pending: bool = False) -> StepMessage:
        """The MIN of every rank's `msg`; `l3_pending`: backups or prefetches are in flight."""

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
    """One rank: the agreed message is the rank's own."""

    async def agree(self, msg: StepMessage, step: int, l3_pending: bool = False) -> StepMessage:
        return msg
