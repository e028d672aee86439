"""The scheduler's index of the host tier: which page (by our chained hash) sits in which slot.

Every worker's host pool mirrors it slot for slot, because every worker carries out the same
plans. Slots are recycled least recently used first, except pinned ones: a slot a load of
this step reads, or one an unfinished prefetch is filling.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict

from hicache_async.pools import PageAllocator


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        self.free = PageAllocator(num_slots, "host")
        self.slot_of: OrderedDict[str, int] = OrderedDict()   # least recently used first
        self.from_l3: set[str] = set()       # pages that came from L3 (where a hit came from)
        self.tenant_of: dict[str, bytes] = {}
        self.pins: Counter[int] = Counter()

    def run(self, hashes: list[str], start: int, stop: int) -> int:
        """How many pages from `start` (up to `stop`) are resident, in a row."""
        n = 0
        while start + n < stop and hashes[start + n] in self.slot_of:
            n += 1
        return n

    def slots(self, hashes: list[str]) -> list[int]:
        """The slots of resident pages, each marked used just now."""
        for h in hashes:
            self.slot_of.move_to_end(h)
        return [self.slot_of[h] for h in hashes]

    def take(self, n: int) -> tuple[list[int], list[tuple[str, int, bytes]]]:
        """Up to `n` slots, free ones first, then the least recently used unpinned pages'; and the
        pages that left: (hash, slot, tenant)."""
        got = self.free.alloc(min(n, self.free.free))
        if len(got) == n:       # the common case: no page leaves, and the index is not walked
            return got, []
        leaving = list(itertools.islice((h for h, slot in self.slot_of.items() if not self.pins[slot]), n - len(got)))
        evicted = []
        for h in leaving:
            self.from_l3.discard(h)
            evicted.append((h, self.slot_of.pop(h), self.tenant_of.pop(h)))
            got.append(evicted[-1][1])
        return got, evicted

    def put(self, page_hash: str, slot: int, tenant: bytes, from_l3: bool = False) -> None:
        self.slot_of[page_hash] = slot
        self.tenant_of[page_hash] = tenant
        if from_l3:
            self.from_l3.add(page_hash)

    def give_back(self, slots: list[int]) -> None:
        """Slots that hold no page (a prefetch that fetched fewer pages)."""
        self.free.release(slots)

    def forget_slots(self, slots: set[int]) -> list[str]:
        """Forget the pages in `slots` (not pinned ones) and free the slots; the pages forgotten."""
        if not slots:
            return []
        gone = [h for h, s in self.slot_of.items() if s in slots and not self.pins[s]]
        for h in gone:
            self.free.release([self.slot_of.pop(h)])
            self.tenant_of.pop(h, None)
            self.from_l3.discard(h)
        return gone

    def pin(self, slots: list[int], by: int = 1) -> None:
        for s in slots:
            self.pins[s] += by
            if self.pins[s] <= 0:
                del self.pins[s]
