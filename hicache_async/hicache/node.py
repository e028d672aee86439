"""A radix tree node: one run of full token pages, where its KV lives, and its locks."""
from __future__ import annotations


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
