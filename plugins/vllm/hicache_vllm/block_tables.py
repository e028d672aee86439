"""What a group's block tables hold, by its kind (`kv_groups.py`), as the scheduler reads them.

Full attention: every block holds KV. A sliding window: vLLM's null block where the window
moved on, so a hit loads only the pages its layers still read at the boundary it ends at, and
vLLM may take back a block that a save still reads. A state group (Mamba, linear attention):
its table's blocks hold a running state, so a save reads only the state blocks vLLM offered
this step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from .host_slots import HostSlots
from .kv_groups import Group
from .plan import NULL_BLOCK


class BlockTables:
    def __init__(self, group: Group | None, page_size: int) -> None:
        self.page_size = page_size
        self.window = group if group is not None and group.reach else None     # a sliding window's group
        # a state group's (Mamba, linear attention): {request: {page: block}} vLLM offered this step
        self.offered: dict[str, dict[int, int]] | None = {} if group is not None and group.kind == "state" else None

    def live(self, block: int) -> bool:
        """Whether a block holds KV: a sliding window's table has vLLM's null block where the
        window moved on (a full-attention table never does)."""
        return self.window is None or block != NULL_BLOCK

    def first_read(self, held: int, stop: int) -> int:
        """The first page an L3 read for a hit ending at `stop` needs: past the `held` run,
        and for a window, one its layers still read there."""
        return max(held, self.window.first_read(stop, self.page_size)) if self.window else held

    def loadable(self, slots: HostSlots, hashes: list[str], start: int, stop: int) -> tuple[int, int]:
        """What a hit loads: (its first page, its pages past `start`). Full attention: the
        HOLDING run from `start`. A sliding window: the furthest boundary up to `stop` whose
        window (the pages from `start` on that its layers still read) the tier holds; vLLM
        leaves the blocks before that window null. Scanned once, backwards: a gap rules out
        every boundary past it."""
        if self.window is None:
            return start, slots.run(hashes, start, stop)
        end = stop
        for page in range(stop - 1, start - 1, -1):
            if not slots.holding(hashes[page]):
                end = page
            elif page <= max(start, self.window.first_read(end, self.page_size)):
                return page, end - start
        return start, 0

    def saveable(self, req_id: str, table: list[int]) -> list[int]:
        """The blocks a save may read: the block table, or for a state group only the state
        blocks vLLM offered this step, each at its boundary's page; its table's other blocks
        hold a running state, not the state at their page's end."""
        if self.offered is None:
            return table
        offered = self.offered.get(req_id, {})
        return [offered.get(p, NULL_BLOCK) for p in range(len(table))]

    def reused(self, reads: Iterable[tuple[str, int, int]], table_of: Callable[[str], list[int] | None]) -> bool:
        """Whether vLLM took back a sliding window's block that a save still reads (`reads`:
        its request, page and block; `table_of`: the request's table, None once it finished):
        every kernel of the step then waits for the saves issued (`fence`). A state group's
        offered block need not be in its request's table at all, nor kept once the request
        finished: any it no longer holds there fences."""
        for req_id, page, block in reads if self.window is not None else ():
            table = table_of(req_id)
            if table is None and self.offered is not None:
                return True
            if table is not None and (page >= len(table) or table[page] != block):
                return True
        return False
