"""When the cache counts an op as complete, and what "now" is for its deadlines.

The step ledger asks its clock, never the op's event directly, so an engine that plans in
modelled time (the replay) can make decisions follow that time alone: it stamps each op with
a modelled completion when it is issued and calls it due once its own clock has passed that,
whatever the wall clock says. The ledger then waits for the op's real bytes, bounded, before
it offers it, so modelled time never lets a rank act on bytes that have not landed.
"""
from __future__ import annotations

import time
from typing import Any


class OpClock:
    """Wall time: an op is due when its completion event fires; deadlines are monotonic."""

    modelled = False
    """Whether `due` follows a model rather than the events (the ledger then awaits them)."""

    def now(self) -> float:
        """Seconds, for op deadlines (a prefetch policy's patience)."""
        return time.monotonic()

    def issued(self, op: Any) -> None:
        """`op` was just issued (its kind, pages and bytes are set)."""

    def due(self, op: Any) -> bool:
        """Whether `op` may be offered as complete at this step."""
        return op.done.query()

    def transfer_s(self, kind: Any, pages: int) -> float | None:
        """Seconds a transfer of `pages` pages takes on every rank, as this clock will time it;
        None when only measuring can tell (wall time)."""
        return None
