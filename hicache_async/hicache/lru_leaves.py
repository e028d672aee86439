"""The radix tree's eviction candidates of one tier, in LRU order, updated as the tree changes."""
from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .node import Node


class LruLeaves:
    """A set of nodes in `(last_access, id)` order: a heap with lazy deletion.

    `_live` maps each member's id to its one valid heap entry; re-filing a node pushes a
    fresh entry and leaves the old one to be skipped, and the heap is rebuilt from `_live`
    once stale entries outnumber live ones, so every update is O(log n) amortised.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Node]] = []
        self._live: dict[int, tuple[int, int, int, Node]] = {}
        self._pushes = 0       # entry serial: ties on (last_access, id) never compare nodes
        self._version = 0      # heap layout changes: an iterator must not resume across one

    def update(self, node: Node, member: bool) -> None:
        entry = self._live.get(node.id)
        if not member:
            if entry is not None:
                del self._live[node.id]
        elif entry is None or entry[0] != node.last_access:
            self._pushes += 1
            entry = self._live[node.id] = (node.last_access, node.id, self._pushes, node)
            self._version += 1
            if len(self._heap) > 2 * len(self._live):
                self._heap = list(self._live.values())
                heapq.heapify(self._heap)
            else:
                heapq.heappush(self._heap, entry)

    def __iter__(self) -> Iterator[Node]:
        """Members LRU first, lazily: walks the heap in order through a frontier of heap
        slots, without popping, so a caller may stop anywhere at O(log n) per step. Members
        may leave meanwhile; a push (a member added or re-keyed) moves entries, so resuming
        after one raises."""
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1]) is not heap[0]:
            heapq.heappop(heap)
            self._version += 1
        version = self._version
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            entry, i = heapq.heappop(frontier)
            if live.get(entry[1]) is entry:
                yield entry[3]
                if self._version != version:
                    raise RuntimeError("LRU leaves re-filed during iteration")
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(heap):
                    heapq.heappush(frontier, (heap[j], j))
