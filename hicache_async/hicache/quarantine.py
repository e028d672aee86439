"""Host pages that a storage call given up on may still write into, kept from other KV until
every rank's call has returned.

A prefetch reads straight into its host pages (`page_store.py`), and a call of it given up on
at its deadline may land bytes long after. The pages a prefetch did not commit are freed as it
retires, at the same step on every rank, so one rank cannot keep its own: its allocator, and
then its tree, would part from the other ranks'. So every rank holds the unused pages of every
retired prefetch here, and releases a set only once every rank says that none of its calls can
still write into it. Each step offers, for the sets in a window of HELD_SLOTS, whether this
rank's late calls for each have returned; the MIN over the world is agreed with the rest of
the step message, and every rank releases the same sets. A set not yet quiet goes to the back
of the line, so a call that never returns holds its own pages, never the sets behind it.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..storage.base import AbandonedCall

HELD_SLOTS = 4      # held sets one step can release


@dataclass
class Held:
    pages: list[int]
    late: list[AbandonedCall]             # this rank's calls that may still write into them
    release: Callable[[list[int]], None]  # gives the pages back to their pool

    def quiet(self) -> bool:
        return all(call.returned() for call in self.late)


class Quarantine:
    def __init__(self) -> None:
        self._held: deque[Held] = deque()
        self.kept = 0       # pages kept from the pool for good at close: their calls had not returned

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, pages: list[int], late: list[AbandonedCall], release: Callable[[list[int]], None]) -> None:
        self._held.append(Held(list(pages), list(late), release))

    def offer(self) -> tuple[int, ...]:
        """Per set in the window, 1 when no call on this rank can still write into it."""
        return tuple(int(held.quiet()) for held in itertools.islice(self._held, HELD_SLOTS))

    def release(self, quiet: tuple[int, ...]) -> list[int]:
        """Give back the sets of the window that every rank agreed `quiet`, and send the rest
        to the back; the pages given back."""
        window = [self._held.popleft() for _ in range(min(HELD_SLOTS, len(self._held)))]
        released: list[int] = []
        for held, agreed in itertools.zip_longest(window, quiet[:len(window)], fillvalue=0):
            if agreed > 0:
                held.release(held.pages)
                released += held.pages
            else:
                self._held.append(held)
        return released

    def late_pages(self) -> int:
        """Pages out of the pool because a call on this rank may still write into them."""
        return self.kept + sum(len(held.pages) for held in self._held if not held.quiet())

    def close(self) -> int:
        """The owner's exit, with no step to agree in: give back every set quiet on this rank
        and keep the rest from the pool for good; the pages kept."""
        for held in self._held:
            if held.quiet():
                held.release(held.pages)
            else:
                self.kept += len(held.pages)
        self._held.clear()
        return self.kept
