"""The replay's op clock: every transfer completes at a modelled time on the virtual clock.

A replay's cache decisions must follow the trace and the modelled hardware alone, never the
machine running it. So an op is due once the virtual clock has passed its modelled
completion: its issue time, plus any wait for the link it moves on (each link is FIFO, as
one DMA engine or one drive's queue would be), plus its bytes over the link's bandwidth,
plus one storage-call latency per L3 call. The ledger then awaits the op's real bytes
(bounded) before acting on it, so modelled time never lets a rank use bytes that have not
landed. Every rank models its own share of each transfer (`HardwareModel.transfer_s`), so
ranks may differ in when an op falls due; the agreement takes the slowest, as it would on
real hardware.
"""
from __future__ import annotations

import heapq
import math

from ...clock import OpClock
from ...topology import RankCoords
from .clock import VirtualClock
from .hardware import HardwareModel


class ModelledClock(OpClock):
    modelled = True

    def __init__(self, virtual: VirtualClock, hardware: HardwareModel, coords: RankCoords, page_size: int) -> None:
        self.virtual, self.hardware, self.coords, self.page_size = virtual, hardware, coords, page_size
        self._link_free_us: dict[str, float] = {}       # link -> when it finishes its queue
        self._events_us: list[float] = []               # dues and policy deadlines ahead
        self._loads_us = 0.0                            # when the loads issued since the last forward land

    def now(self) -> float:
        return self.virtual.now_us / 1e6

    def transfer_s(self, kind, pages: int) -> float:
        """Seconds a transfer takes on idle links, on its slowest rank: what the cost rule
        weighs, the same on every rank."""
        c = self.coords
        return max(sum(self.hardware.transfer_s(str(kind), pages, RankCoords.of(r, c.tp_size, c.pp_size, c.cp_size),
                                                self.page_size))
                   for r in range(c.world_size))

    def issued(self, op) -> None:
        kind = str(op.kind)
        busy_s, latency_s = self.hardware.transfer_s(kind, op.pages, self.coords, self.page_size)
        start = max(self.virtual.now_us, self._link_free_us.get(kind, 0.0))
        self._link_free_us[kind] = start + busy_s * 1e6
        due = op.due_us = start + (busy_s + latency_s) * 1e6
        heapq.heappush(self._events_us, due)
        deadline = getattr(op, "deadline", math.inf)
        if deadline < math.inf:
            heapq.heappush(self._events_us, _past(deadline))
        if kind == "load":
            self._loads_us = max(self._loads_us, due)

    def due(self, op) -> bool:
        return self.virtual.now_us >= op.due_us

    def next_event_us(self) -> float:
        """The earliest modelled completion or policy deadline still ahead (inf: none)."""
        events, now = self._events_us, self.virtual.now_us
        while events and events[0] <= now:
            heapq.heappop(events)
        return events[0] if events else math.inf

    def take_loads_us(self) -> float:
        """When the loads issued since the last call land: the forward pass that reads them
        cannot end before that."""
        landed, self._loads_us = self._loads_us, 0.0
        return landed


def _past(deadline_s: float) -> float:
    """The first virtual microsecond at which `now() > deadline_s` holds."""
    us = deadline_s * 1e6
    while us / 1e6 <= deadline_s:
        us = math.nextafter(us, math.inf)
    return us
