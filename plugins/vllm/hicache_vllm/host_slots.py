"""Every host slot's life, in one place: the scheduler's view of the host tier.

Each worker's host pool mirrors this slot for slot, because every worker carries out the same
plans; the workers' reports are this object's transitions. A slot is in exactly one state:

    FREE ──fill──▶ FILLING ──filled on every worker──▶ HOLDING ──evict──▶ FREE
                     │                                    │
                     └── prefetch ended short ──▶ FREE    └─ evict while read, or write_back
                                                             while not yet in L3 ──▶ LEAVING
                                                             ──last reader done──▶ FREE

Readers are loads (slot → vLLM blocks) and backups (slot → L3); each is a token that every
worker reports done. Late writers are L3 reads a worker gave up on that may still land. The
rules, asserted by `check` and by the property test:

1. A slot is written (filled) only when FREE: nothing reads its previous page and no late
   write may still land in it.
2. A key is stored only from a slot whose fill landed: a backup reads a HOLDING slot, or one
   still FILLING by the save it follows, which each worker starts only once that save landed
   there (each worker stores its own share, from its own slot).
3. A slot appears at most once among one plan's fills (`take` hands out FREE slots only).
4. A page is loaded only from a HOLDING slot (`run` counts HOLDING pages only).
Fills and reads complete on reports that may come steps later: nothing here assumes a step.

A step's work is in the slots it changes, whatever the tier's size: FREE slots and evictable
ones (HOLDING, no reader) wait in their own queues, kept on each transition, so `take` pops
what it hands out or evicts and never walks the index. A page's recency is when it was last
touched or last became evictable (its fill landed, its last reader finished).
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


class State(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    HOLDING = "holding"
    LEAVING = "leaving"


@dataclass
class Slot:
    state: State = State.FREE
    page: str | None = None
    tenant: bytes = b""
    fill: Hashable | None = None                          # FILLING: the save or prefetch filling it
    readers: set = field(default_factory=set)             # tokens of loads and backups reading it
    late: int = 0                                         # workers whose abandoned reads may land
    from_l3: bool = False


class SlotError(AssertionError):
    """A transition the life cycle forbids: a bug in the scheduler, never a user's error."""


class HostSlots:
    def __init__(self, num_slots: int) -> None:
        self.slots = [Slot() for _ in range(num_slots)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))     # the oldest freed first
        self.slot_of: dict[str, int] = {}                  # HOLDING or FILLING (by a save) pages
        self.evictable: OrderedDict[int, None] = OrderedDict()      # HOLDING slots no one reads, LRU first
        self._reading: dict[Hashable, list[int]] = {}
        self._gone: list[str] = []

    # -- questions -------------------------------------------------------------------------

    def run(self, hashes: list[str], start: int, stop: int) -> int:
        """How many pages from `start` (up to `stop`) are HOLDING, in a row: loadable."""
        n = 0
        while start + n < stop and self.holding(hashes[start + n]):
            n += 1
        return n

    def holding(self, page: str) -> bool:
        slot = self.slot_of.get(page)
        return slot is not None and self.slots[slot].state is State.HOLDING

    def has(self, page: str) -> bool:
        """In the tier or being saved into it: a second save would be wasted."""
        return page in self.slot_of

    def touch(self, hashes: list[str]) -> list[int]:
        """The slots of HOLDING pages, each marked used just now."""
        slots = [self.slot_of[h] for h in hashes]
        for slot in slots:
            if slot in self.evictable:
                self.evictable.move_to_end(slot)
        return slots

    # -- transitions -----------------------------------------------------------------------

    def take(self, n: int, keep: Callable[[str], bool], backup: Hashable) -> tuple[list[int], list[tuple[str, int, bytes]]]:
        """Up to `n` FREE slots, evicting least recently used pages no one reads. A page that
        must reach L3 first (`keep`, under write_back) becomes LEAVING instead, read by the
        `backup` token, and its slot is not handed out: returned as (page, slot, tenant) for
        that backup. Never waits: fewer slots than asked is the answer when none are free."""
        leaving: list[tuple[str, int, bytes]] = []
        while len(self.free) + len(leaving) < n and self.evictable:    # the leaving ones serve a later step
            slot, _ = self.evictable.popitem(last=False)
            s = self.slots[slot]
            if keep(s.page):
                leaving.append((s.page, slot, s.tenant))
                s.readers.add(backup)
                self._reading.setdefault(backup, []).append(slot)
            self._leave(slot)
        return self._alloc(n), leaving

    def evicted(self) -> list[str]:
        """Pages that left the tier since the last call (for the CPU `BlockRemoved` events)."""
        gone, self._gone = self._gone, []
        return gone

    def fill(self, slot: int, page: str, tenant: bytes, by: Hashable, indexed: bool) -> None:
        """`slot` (just taken) is being filled with `page`; a save's page is `indexed` at once
        (so it is not saved twice), a prefetch's only once verified."""
        s = self.slots[slot]
        if s.state is not State.FILLING or s.fill is not None:
            raise SlotError(f"slot {slot} filled while {s.state.value}")
        s.page, s.tenant, s.fill = page, tenant, by
        if indexed:
            self.slot_of[page] = slot

    def filled(self, by: Hashable, slots: list[int], verified: int | None = None, from_l3: bool = False) -> list[str]:
        """The fill `by` completed on every worker: its first `verified` slots (all when None)
        hold their page; the rest (a prefetch that ended short), and pages the tier already
        holds elsewhere, become FREE. The pages now HOLDING."""
        held = []
        for i, slot in enumerate(slots):
            s = self.slots[slot]
            if s.fill != by:
                raise SlotError(f"slot {slot} reported filled by {by!r}, but {s.state.value} by {s.fill!r}")
            s.fill = None
            elsewhere = self.slot_of.get(s.page, slot) != slot
            if (verified is None or i < verified) and not elsewhere:
                s.state, s.from_l3 = State.HOLDING, from_l3
                self.slot_of[s.page] = slot
                self._maybe_evictable(slot)
                held.append(s.page)
            else:
                if self.slot_of.get(s.page) == slot:
                    del self.slot_of[s.page]
                s.state, s.page = State.LEAVING, None
                self._maybe_free(slot)
        return held

    def read(self, token: Hashable, slots: list[int], after_fill: bool = False) -> None:
        """`token` (a load or a backup) reads `slots` until `done(token)`; a backup `after_fill`
        may be added to slots a save is filling, since it starts only once that save landed."""
        readable = (State.HOLDING, State.LEAVING, State.FILLING) if after_fill else (State.HOLDING, State.LEAVING)
        for slot in slots:
            if self.slots[slot].state not in readable:
                raise SlotError(f"slot {slot} read by {token!r} while {self.slots[slot].state.value}")
            self.slots[slot].readers.add(token)
            self.evictable.pop(slot, None)
        self._reading.setdefault(token, []).extend(slots)

    def done(self, token: Hashable) -> None:
        """Every worker finished reading for `token`."""
        for slot in self._reading.pop(token, ()):
            self.slots[slot].readers.discard(token)
            self._maybe_evictable(slot)
            self._maybe_free(slot)

    def late(self, slot: int, workers: int) -> None:
        """`workers` more (or, negative, fewer) abandoned L3 reads may still write `slot`."""
        s = self.slots[slot]
        s.late += workers
        if s.late < 0:
            raise SlotError(f"slot {slot} released by more late reads than held it")
        if s.state is State.FREE and s.late:
            del self.free[slot]
            s.state = State.LEAVING
        self._maybe_free(slot)

    def used_from_l3(self, pages: list[str]) -> int:
        """How many of `pages` came from L3 and are used for the first time now."""
        n = 0
        for h in pages:
            s = self.slots[self.slot_of[h]]
            n += s.from_l3
            s.from_l3 = False
        return n

    # -- the invariants ----------------------------------------------------------------------

    def check(self) -> None:
        """Raise SlotError where the life cycle is broken."""
        for i, s in enumerate(self.slots):
            if (i in self.free) != (s.state is State.FREE):
                raise SlotError(f"slot {i} is {s.state.value} but {'' if i in self.free else 'not '}on the free list")
            if s.state is State.FREE and (s.readers or s.late or s.page):
                raise SlotError(f"free slot {i} still has a page, a reader or a late write")
            if s.state is State.FILLING and (s.fill is None or any(isinstance(r, tuple) for r in s.readers)):
                raise SlotError(f"filling slot {i} is loaded from, or filled by nothing")
            if s.state is State.HOLDING and self.slot_of.get(s.page) != i:
                raise SlotError(f"holding slot {i} is not indexed by its page")
            if (i in self.evictable) != (s.state is State.HOLDING and not s.readers):
                raise SlotError(f"slot {i} is {s.state.value}, read by {len(s.readers)}, but "
                                f"{'' if i in self.evictable else 'not '}evictable")
        for page, slot in self.slot_of.items():
            if self.slots[slot].page != page or self.slots[slot].state not in (State.FILLING, State.HOLDING):
                raise SlotError(f"page {page[:12]} indexed in slot {slot}, which holds something else")

    # -- inside ------------------------------------------------------------------------------

    def _alloc(self, n: int) -> list[int]:
        got = [self.free.popitem(last=False)[0] for _ in range(min(n, len(self.free)))]
        for slot in got:
            self.slots[slot].state = State.FILLING
        return got

    def _leave(self, slot: int) -> None:
        """The slot's page leaves the tier; the slot is FREE once no one reads it."""
        s = self.slots[slot]
        del self.slot_of[s.page]
        self._gone.append(s.page)
        s.state, s.from_l3 = State.LEAVING, False
        self._maybe_free(slot)

    def _maybe_evictable(self, slot: int) -> None:
        """A HOLDING slot no one reads (any more) may be evicted: the most recently used now."""
        s = self.slots[slot]
        if s.state is State.HOLDING and not s.readers:
            self.evictable[slot] = None

    def _maybe_free(self, slot: int) -> None:
        s = self.slots[slot]
        if s.state is State.LEAVING and not s.readers and not s.late:
            s.state, s.page, s.tenant = State.FREE, None, b""
            self.free[slot] = None
