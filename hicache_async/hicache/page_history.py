"""What became of each page the cache ever held, so that a miss can name its cause, and so a
prefetch under a modelled clock asks L3 only for what every rank knows it holds.

A page the oracle says was reusable but a request computed anyway was either never cached
here yet (its first request was still being computed), or cached and then evicted, either
with no copy in L3 or before its backup retired, or in L3 but not fetched in time. The tree
forgets evicted pages, so this keeps one entry per page ever inserted (keyed by 64 bits of
its hash) saying whether a backup of it has retired. `Miss` names the reasons.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Miss(str, Enum):
    """Why the first page after a request's served prefix was not served."""

    STILL_COMPUTING = "prefix_still_computing"        # no request holding it had finished
    EVICTED = "evicted_for_capacity"                  # left L1/L2, and no L3 to fall back on
    DROPPED_BEFORE_BACKUP = "dropped_before_backup"   # left L1/L2 before a backup of it retired
    DECLINED = "prefetch_declined_by_cost"            # in L3; recomputing was judged cheaper
    NO_HOST_ROOM = "no_host_room_for_prefetch"        # in L3; L2 had no room to fetch it into
    CUT_SHORT = "prefetch_cut_short"                  # in L3; its prefetch was given up on
    EVICTED_AFTER_FETCH = "evicted_after_prefetch"    # fetched into L2, evicted before use
    EVICTED_WHILE_WAITING = "evicted_while_waiting"   # cached when the request looked at L3, gone by its turn

    def __str__(self) -> str:
        return self.value


def _key(page_hash: str) -> str:
    return page_hash[:16]     # 64 bits of a SHA-256 name a page well enough, in a third of the memory


class PageHistory:
    def __init__(self) -> None:
        self._backed_up: dict[str, bool] = {}     # every page ever inserted -> a backup of it retired

    def inserted(self, hashes: list[str]) -> None:
        for h in hashes:
            self._backed_up.setdefault(_key(h), False)

    def backed_up(self, hashes: list[str]) -> int:
        """Note the pages of a retired backup (or prefetch) as in L3; returns how many of them
        this run never cached (found in L3 from before it).

        Every page of the op, whatever this rank's storage answered: what a rank's calls did
        differs between ranks, and a prefetch asks for what every rank noted. A page some rank
        failed to store is then read and found missing there, and the agreed MIN of what the
        ranks read counts it as a miss on all of them."""
        earlier = 0
        for h in hashes:
            key = _key(h)
            earlier += key not in self._backed_up
            self._backed_up[key] = True
        return earlier

    def stored_run(self, hashes: list[str], first: int, probe: Callable[[list[str]], int]) -> int:
        """How many pages from `first` on are in L3, in a leading run, as every rank knows it: a
        page this run cached is there once a backup of it retired; one it never cached can only
        be there from before the run, which no backup of this run can change, so `probe`
        (leading pages present in storage) answers for those."""
        n = first
        while n < len(hashes):
            backed_up = self._backed_up.get(_key(hashes[n]))
            if backed_up is None:
                unknown = n + 1
                while unknown < len(hashes) and _key(hashes[unknown]) not in self._backed_up:
                    unknown += 1
                found = probe(hashes[n:unknown])
                n += found
                if n < unknown:
                    break
            elif backed_up:
                n += 1
            else:
                break
        return n - first

    def why_absent(self, page_hash: str, l3: bool) -> Miss:
        """Why a page that is not in L1/L2 now is not there."""
        backed_up = self._backed_up.get(_key(page_hash))
        if backed_up is None:
            return Miss.STILL_COMPUTING
        if not l3:
            return Miss.EVICTED
        return Miss.EVICTED_WHILE_WAITING if backed_up else Miss.DROPPED_BEFORE_BACKUP


@dataclass(frozen=True)
class L3Look:
    """A request's one look at L3 on admission: pages `first` to `end` (exclusive) were there,
    `beyond` says why page `end` was not, and `outcome` what became of fetching them
    (None: it was fetched)."""

    first: int
    end: int
    beyond: Miss | None
    outcome: Miss | None

    def why_missed(self, page: int, committed: int) -> Miss | None:
        """Why `page` was not served, if this look decided it; `committed`: pages fetched."""
        if page < self.first:
            return None
        if page >= self.end:
            return self.beyond
        if self.outcome is not None:
            return self.outcome
        return Miss.EVICTED_AFTER_FETCH if page < self.first + committed else Miss.CUT_SHORT
