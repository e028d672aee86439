"""Radix tree over full token pages: matching, insertion, grafting and removal.

Invariants the plugin relies on (and the property tests check):
- device-resident nodes form a rooted subtree, so a match is a device run then a host run;
- a node is resident somewhere (device, host or both) or it is not in the tree;
- a locked node is never evicted from the tier its lock protects;
- every LRU decision uses a logical clock and node ids, never wall time, so identical
  call sequences on different ranks give identical trees;
- each tenant (`cache_salt`) has its own root, so no token prefix matches across tenants;
  a root has no parent, holds no pages and is never evicted.

Where each node's pages live, its locks and the eviction candidates are `Residency`'s
(residency.py), which the tree builds on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .residency import Residency


class Node:
    """One run of pages. Residency, locks and `last_access` change only through `RadixTree`
    methods, which keep the tree's LRU leaf sets in step with them."""

    __slots__ = ("id", "parent", "children", "tokens", "hashes", "device", "host",
                 "device_lock", "host_lock", "last_access", "hits", "fetched", "device_children", "salt")

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
        self.salt = parent.salt if parent is not None else None   # the tenant whose tree holds it

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


class RadixTree(Residency):
    def __init__(self, page_size: int) -> None:
        super().__init__()
        self.page_size = page_size
        self.root = Node(0, None, (), [], [], [])
        self._tenants: dict[str, Node] = {}     # cache_salt -> its root; no salt: `root`
        self._next_id = 1
        self.nodes: dict[int, Node] = {}

    def tenant_root(self, salt: str | None) -> Node:
        """The root of `salt`'s tree, made on first use; one empty node a tenant, kept."""
        if salt is None:
            return self.root
        root = self._tenants.get(salt)
        if root is None:
            root = self._tenants[salt] = Node(self._take_id(), None, (), [], [], [])
            root.salt = salt
        return root

    # -- lookup and insertion --------------------------------------------------------------

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> Match:
        """Longest cached prefix of `tokens` in full pages in `salt`'s tree; touches and counts
        the path."""
        match = Match(page_size=self.page_size)
        self.clock += 1
        for node in self._walk(tokens, self.tenant_root(salt)):
            self._touch(node)
            node.hits += 1
            if node.device is not None and not match.host_nodes:
                match.device_nodes.append(node)
            else:
                match.host_nodes.append(node)
        return match

    def insert(self, tokens: list[int], device_pages: list[int], hashes: list[str],
               salt: str | None = None) -> Inserted:
        """Insert the full pages of `tokens` whose KV sits in `device_pages` into `salt`'s tree.

        Pages the tree already holds on the device come back as duplicates; host-only
        nodes on the path adopt the caller's device pages instead of copying them back.
        """
        ps = self.page_size
        n_pages = len(tokens) // ps
        assert len(device_pages) >= n_pages and len(hashes) >= n_pages
        self.clock += 1
        duplicates: list[int] = []
        node = root = self.tenant_root(salt)
        done = 0
        for node in self._walk(tokens[: n_pages * ps], root):
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
                   host_pages: list[int], salt: str | None = None) -> list[int]:
        """Insert pages fetched from storage as a host-only node below the cached prefix in
        `salt`'s tree.

        `tokens` is the whole path; pages before `first_page` are already in the tree.
        Pages that someone cached meanwhile are not grafted: they come back to be freed.
        """
        ps = self.page_size
        n_pages = first_page + len(host_pages)
        self.clock += 1
        node = root = self.tenant_root(salt)
        done = 0
        for node in self._walk(tokens[: n_pages * ps], root):
            done += node.num_pages
        assert done >= first_page, "the prefix a prefetch grafts onto was evicted"
        if done < n_pages:
            k = done - first_page
            node = self._add_child(node, tuple(tokens[done * ps: n_pages * ps]),
                                   hashes[done:n_pages], None, list(host_pages[k:]))
            node.fetched = True
            return list(host_pages[:k])
        return list(host_pages)

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
            self._forget(n)
        parent = node.parent
        del parent.children[node.tokens[: self.page_size]]
        parent.device_children -= node.device is not None
        self._refile(parent)
        return device, host

    # -- internals -------------------------------------------------------------------------

    def _walk(self, tokens: list[int], node: Node):
        """Yield the nodes matching `tokens` page by page below root `node`, splitting the last
        partial node."""
        ps = self.page_size
        i = 0
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

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1
