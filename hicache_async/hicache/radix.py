"""Radix tree over full token pages, with per-node residency on the device and host tiers.

Invariants the plugin relies on (and the property tests check):
- device-resident nodes form a rooted subtree, so a match is a device run then a host run;
- a node is resident somewhere (device, host or both) or it is not in the tree;
- a locked node is never evicted from the tier its lock protects;
- every LRU decision uses a logical clock and node ids, never wall time, so identical
  call sequences on different ranks give identical trees.

Eviction candidates are kept in two `LruLeaves` sets updated as the tree changes, so no
operation costs more than the pages it touches plus O(log n) per node it re-files.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from .lru_leaves import LruLeaves


class Node:
    """One run of pages. Residency, locks and `last_access` change only through `RadixTree`
    methods, which keep the tree's LRU leaf sets in step with them."""

    __slots__ = ("id", "parent", "children", "tokens", "hashes", "device", "host",
                 "device_lock", "host_lock", "last_access", "hits", "fetched", "device_children")

    def __init__(self, node_id: int, parent: "Node | None", tokens: tuple[int, ...],
                 hashes: list[str], device: list[int] | None, host: list[int] | None) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.tokens = tokens
        self.hashes = hashes
        self.device = device
        self.host = host
        self.device_lock = 0
        self.host_lock = 0
        self.last_access = 0
        self.hits = 0
        self.fetched = False    # came from L3 and not yet used: its first hit counts as L3
        self.device_children = 0   # children with a device copy: a device leaf has none

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    def __repr__(self) -> str:
        return (f"Node({self.id}, pages={self.num_pages}, device={self.device is not None}, "
                f"host={self.host is not None}, locks={self.device_lock}/{self.host_lock})")


@dataclass
class Match:
    """Result of `match_prefix`: a device-resident run, then a host-only run."""

    device_nodes: list[Node] = field(default_factory=list)
    host_nodes: list[Node] = field(default_factory=list)
    page_size: int = 1

    @property
    def device_pages(self) -> list[int]:
        return [p for n in self.device_nodes for p in n.device]

    @property
    def device_tokens(self) -> int:
        return sum(n.num_pages for n in self.device_nodes) * self.page_size

    @property
    def host_tokens(self) -> int:
        return sum(n.num_pages for n in self.host_nodes) * self.page_size

    @property
    def last_node(self) -> "Node | None":
        nodes = self.host_nodes or self.device_nodes
        return nodes[-1] if nodes else None


@dataclass
class Inserted:
    """Result of `insert`: the last node, pages the caller must free, and nodes to write."""

    last: Node
    duplicate_pages: list[int]
    new_nodes: list[Node]


class RadixTree:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = Node(0, None, (), [], [], [])
        self._next_id = 1
        self.clock = 0
        self.nodes: dict[int, Node] = {}
        self._device_leaves = LruLeaves()
        self._host_leaves = LruLeaves()

    # -- lookup and insertion --------------------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> Match:
        """Longest cached prefix of `tokens` in full pages; touches and counts the path."""
        match = Match(page_size=self.page_size)
        self.clock += 1
        for node in self._walk(tokens):
            self._touch(node)
            node.hits += 1
            if node.device is not None and not match.host_nodes:
                match.device_nodes.append(node)
            else:
                match.host_nodes.append(node)
        return match

    def insert(self, tokens: list[int], device_pages: list[int], hashes: list[str]) -> Inserted:
        """Insert the full pages of `tokens` whose KV sits in `device_pages`.

        Pages the tree already holds on the device come back as duplicates; host-only
        nodes on the path adopt the caller's device pages instead of copying them back.
        """
        ps = self.page_size
        n_pages = len(tokens) // ps
        assert len(device_pages) >= n_pages and len(hashes) >= n_pages
        self.clock += 1
        duplicates: list[int] = []
        node, done = self.root, 0
        for node in self._walk(tokens[: n_pages * ps]):
            mine = device_pages[done: done + node.num_pages]
            self._touch(node)
            if node.device is None:
                self.set_device(node, list(mine))
            else:
                duplicates.extend(p for p, q in zip(mine, node.device) if p != q)
            done += node.num_pages
        new_nodes = []
        if done < n_pages:
            node = self._add_child(node, tuple(tokens[done * ps: n_pages * ps]),
                                   hashes[done:n_pages], list(device_pages[done:n_pages]))
            node.hits = 1
            new_nodes.append(node)
        return Inserted(node, duplicates, new_nodes)

    def graft_host(self, tokens: list[int], first_page: int, hashes: list[str],
                   host_pages: list[int]) -> list[int]:
        """Insert pages fetched from storage as a host-only node below the cached prefix.

        `tokens` is the whole path; pages before `first_page` are already in the tree.
        Pages that someone cached meanwhile are not grafted: they come back to be freed.
        """
        ps = self.page_size
        n_pages = first_page + len(host_pages)
        self.clock += 1
        node, done = self.root, 0
        for node in self._walk(tokens[: n_pages * ps]):
            done += node.num_pages
        assert done >= first_page, "the prefix a prefetch grafts onto was evicted"
        if done < n_pages:
            k = done - first_page
            node = self._add_child(node, tuple(tokens[done * ps: n_pages * ps]),
                                   hashes[done:n_pages], None, list(host_pages[k:]))
            node.fetched = True
            return list(host_pages[:k])
        return list(host_pages)

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

    def path_to(self, node: Node | None) -> list[Node]:
        out = []
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    # -- locks -------------------------------------------------------------------------------

    def lock_device(self, node: Node | None, delta: int = 1) -> None:
        """Lock (or unlock, delta=-1) `node` and its ancestors against device eviction.

        Locks cover whole paths so that splitting a locked node leaves both halves
        covered, and the later unlock of the lower half releases the upper one too.
        """
        for n in self.path_to(node):
            n.device_lock += delta
            assert n.device_lock >= 0, f"device lock of node {n.id} went negative"
            self._refile(n)

    def lock_host(self, node: Node | None, delta: int = 1) -> None:
        """Like `lock_device`, against host eviction."""
        for n in self.path_to(node):
            n.host_lock += delta
            assert n.host_lock >= 0, f"host lock of node {n.id} went negative"
            self._refile(n)

    def pin(self, node: Node | None, delta: int = 1) -> None:
        """Lock (or unlock) `node`'s path on both tiers: an op in flight, or a graft point."""
        self.lock_device(node, delta)
        self.lock_host(node, delta)

    # -- eviction ------------------------------------------------------------------------

    def lru_device_leaves(self) -> Iterator[Node]:
        """Unlocked device-resident nodes with no device-resident child, LRU first, lazily.

        It may resume after changes that only take device leaves out (a lock, a write);
        after one that can add or re-key one (an eviction, a removal, an unlock, a match),
        stop: resuming raises rather than yield a stale order."""
        return iter(self._device_leaves)

    def lru_host_leaves(self) -> Iterator[Node]:
        """Unlocked host-only nodes with no children, LRU first, lazily."""
        return iter(self._host_leaves)

    def evict_device(self, node: Node) -> list[int]:
        """Drop the device copy of a node that has a host copy; returns the freed pages."""
        assert node.host is not None and node.device_lock == 0
        assert not node.device_children, "not a device leaf"
        pages, node.device = node.device, None
        node.parent.device_children -= 1
        self._refile(node)
        self._refile(node.parent)
        return pages

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

    def remove(self, node: Node) -> tuple[list[int], list[int]]:
        """Remove a node and its subtree; returns (device pages, host pages) to free."""
        device: list[int] = []
        host: list[int] = []
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.device_lock == 0 and n.host_lock == 0, f"removing locked {n}"
            device.extend(n.device or ())
            host.extend(n.host or ())
            stack.extend(n.children.values())
            del self.nodes[n.id]
            self._device_leaves.update(n, False)
            self._host_leaves.update(n, False)
        parent = node.parent
        del parent.children[node.tokens[: self.page_size]]
        parent.device_children -= node.device is not None
        self._refile(parent)
        return device, host

    # -- internals -------------------------------------------------------------------------

    def _walk(self, tokens: list[int]):
        """Yield the nodes matching `tokens` page by page, splitting the last partial node."""
        ps = self.page_size
        node, i = self.root, 0
        while i + ps <= len(tokens):
            child = node.children.get(tuple(tokens[i: i + ps]))
            if child is None:
                return
            common = 1
            while (common < child.num_pages and i + (common + 1) * ps <= len(tokens)
                   and child.tokens[common * ps: (common + 1) * ps]
                   == tuple(tokens[i + common * ps: i + (common + 1) * ps])):
                common += 1
            if common < child.num_pages:
                child = self._split(child, common)
            yield child
            i += common * ps
            node = child

    def _split(self, node: Node, pages: int) -> Node:
        """Split `node` after `pages` pages; returns the new upper part."""
        ps = self.page_size
        upper = Node(self._take_id(), node.parent, node.tokens[: pages * ps], node.hashes[:pages],
                     node.device[:pages] if node.device is not None else None,
                     node.host[:pages] if node.host is not None else None)
        upper.device_lock, upper.host_lock = node.device_lock, node.host_lock
        upper.last_access, upper.hits = node.last_access, node.hits
        upper.fetched = node.fetched
        # Never a leaf: its one child, the lower part, has its residency. The lower part
        # keeps its key and leaf status, and the parent its counts.
        upper.device_children = int(node.device is not None)
        node.parent.children[upper.tokens[:ps]] = upper
        node.tokens, node.hashes = node.tokens[pages * ps:], node.hashes[pages:]
        node.device = node.device[pages:] if node.device is not None else None
        node.host = node.host[pages:] if node.host is not None else None
        node.parent = upper
        upper.children[node.tokens[:ps]] = node
        self.nodes[upper.id] = upper
        return upper

    def _add_child(self, parent: Node, tokens: tuple[int, ...], hashes: list[str],
                   device: list[int] | None, host: list[int] | None = None) -> Node:
        node = Node(self._take_id(), parent, tokens, list(hashes), device, host)
        parent.children[tokens[: self.page_size]] = node
        parent.device_children += device is not None
        self.nodes[node.id] = node
        self._touch(node)
        self._refile(parent)
        return node

    def _touch(self, node: Node) -> None:
        node.last_access = self.clock
        self._refile(node)

    def _refile(self, node: Node) -> None:
        """Put `node` in or out of the leaf sets after its residency, locks, children or
        last access changed; the definitions here are the ones eviction relies on."""
        if node is self.root:
            return
        self._device_leaves.update(node, node.device is not None and node.device_lock == 0
                                   and node.device_children == 0)
        self._host_leaves.update(node, node.device is None and node.host is not None
                                 and node.host_lock == 0 and not node.children)

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1
