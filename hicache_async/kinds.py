"""The four kinds of transfer, each named once, with the tiers it moves pages between."""
from __future__ import annotations

from enum import Enum


class TransferKind(str, Enum):
    """A transfer kind; its value is the name spans, metrics and reports use."""

    WRITE = "write"          # L1 -> L2
    LOAD = "load"            # L2 -> L1
    BACKUP = "backup"        # L2 -> L3
    PREFETCH = "prefetch"    # L3 -> L2

    @property
    def route(self) -> tuple[str, str]:
        """(source tier, destination tier)."""
        return _ROUTES[self]

    @property
    def storage(self) -> bool:
        """Whether it is an L3 transfer, run by a storage worker."""
        return self in (TransferKind.BACKUP, TransferKind.PREFETCH)

    def __str__(self) -> str:
        return self.value


_ROUTES = {TransferKind.WRITE: ("l1", "l2"), TransferKind.LOAD: ("l2", "l1"),
           TransferKind.BACKUP: ("l2", "l3"), TransferKind.PREFETCH: ("l3", "l2")}
