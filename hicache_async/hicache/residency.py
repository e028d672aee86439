"""Where the radix tree's pages live, and which of them each tier may evict.

The tree's shape (`radix.py`) says which tokens a node holds; this says on which tier its
pages are, which locks keep them there, and which nodes are eviction candidates, kept in
two `LruLeaves` sets updated as residency, locks, children or last access change. So no
operation costs more than the pages it touches plus O(log n) per node it re-files.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .lru_leaves import LruLeaves

if TYPE_CHECKING:
    from .radix import Node


class Residency:
    """The residency half of `RadixTree`, which builds on it. A root (the tree's, or a
    tenant's) is a node without a parent."""

    def __init__(self) -> None:
        self.clock = 0          # logical: every LRU decision is the same on every rank
        self._device_leaves = LruLeaves()
        self._host_leaves = LruLeaves()

    # -- residency -------------------------------------------------------------------------

    def set_device(self, node: Node, pages: list[int]) -> None:
        """Give a host-only node device pages (a load, or an insert adopting it)."""
        assert node.device is None and node.parent.device is not None, "device nodes form a rooted subtree"
        node.device = pages
        node.parent.device_children += 1
        self._refile(node)
        self._refile(node.parent)

    def set_host(self, node: Node, pages: list[int]) -> None:
        """Record the host copy a write makes of a device node."""
        assert node.host is None, f"{node} already has a host copy"
        node.host = pages
        self._refile(node)

    def evict_device(self, node: Node) -> list[int]:
        """Drop the device copy of a node that has a host copy; returns the freed pages."""
        assert node.host is not None and node.device_lock == 0
        assert not node.device_children, "not a device leaf"
        pages, node.device = node.device, None
        node.parent.device_children -= 1
        self._refile(node)
        self._refile(node.parent)
        return pages

    # -- locks -----------------------------------------------------------------------------

    def path_to(self, node: Node | None) -> list[Node]:
        """`node` and its ancestors, root first, without the root (the tree's or a tenant's)."""
        out = []
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def lock_device(self, node: Node | None, delta: int = 1) -> None:
        """Lock (or unlock, delta=-1) `node` and its ancestors against device eviction.

        Locks cover whole paths so that splitting a locked node leaves both halves
        covered, and the later unlock of the lower half releases the upper one too.
        """
        self._lock(node, delta, 0)

    def lock_host(self, node: Node | None, delta: int = 1) -> None:
        """Like `lock_device`, against host eviction."""
        self._lock(node, 0, delta)

    def pin(self, node: Node | None, delta: int = 1) -> None:
        """Lock (or unlock) `node`'s path on both tiers: an op in flight, or a graft point."""
        self._lock(node, delta, delta)

    def _lock(self, node: Node | None, device: int, host: int) -> None:
        """One walk of the path for both tiers: pins run for every op retired each step."""
        for n in self.path_to(node):
            n.device_lock += device
            n.host_lock += host
            assert n.device_lock >= 0 and n.host_lock >= 0, f"a lock of node {n.id} went negative"
            self._refile(n)

    def removable(self, node: Node) -> bool:
        """Whether no node in `node`'s subtree is locked on either tier.

        Its own locks say so. A lock adds 1 on every node of the path from the root to its
        target and its unlock takes 1 from that path, so a node's count is the number of
        live locks whose target lies in its subtree, which is at least any descendant's.
        Paths change in two ways only, and both keep this: a split puts the upper part on
        exactly the paths through the lower part and gives it the lower part's counts, and
        removal takes only subtrees no live lock targets (their root's counts are 0).
        """
        return node.device_lock == 0 and node.host_lock == 0

    # -- eviction candidates -----------------------------------------------------------------

    def lru_device_leaves(self) -> Iterator[Node]:
        """Unlocked device-resident nodes with no device-resident child, LRU first, lazily.

        It may resume after changes that only take device leaves out (a lock, a write);
        after one that can add or re-key one (an eviction, a removal, an unlock, a match),
        stop: resuming raises rather than yield a stale order."""
        return iter(self._device_leaves)

    def lru_host_leaves(self) -> Iterator[Node]:
        """Unlocked host-only nodes with no children, LRU first, lazily."""
        return iter(self._host_leaves)

    def _touch(self, node: Node) -> None:
        node.last_access = self.clock
        self._refile(node)

    def _forget(self, node: Node) -> None:
        """`node` left the tree: it is no candidate any more."""
        self._device_leaves.update(node, False)
        self._host_leaves.update(node, False)

    def _refile(self, node: Node) -> None:
        """Put `node` in or out of the leaf sets after its residency, locks, children or
        last access changed; the definitions here are the ones eviction relies on."""
        if node.parent is None:     # a root: never evicted
            return
        self._device_leaves.update(node, node.device is not None and node.device_lock == 0
                                   and node.device_children == 0)
        self._host_leaves.update(node, node.device is None and node.host is not None
                                 and node.host_lock == 0 and not node.children)
