"""The L1/L2 tier state machine: allocation with eviction, and the write/load ops it issues.

Every decision here is a pure function of the tree and the pools, both of which change
only through calls made in the same order on every rank, so ranks stay identical. Each
decision is folded into `digest`, which the agreement compares across ranks.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from ..config import CacheConfig
from .ops import AckQueue, CacheOp
from ..transfer.pool import DevicePool, HostPool
from .radix import Match, Node, RadixTree
from ..transfer.copier import Copier

WRITE_ON_EVICT = ("write_back", "write_through_selective")


class TieredCache:
    def __init__(self, config: CacheConfig, device: DevicePool, host: HostPool,
                 on_issue=lambda op, request_ids: None) -> None:
        self.config = config
        self.device, self.host = device, host
        self.tree = RadixTree(config.page_size)
        self.copier = Copier(device, host)
        self.writes = AckQueue("write")
        self.loads = AckQueue("load")
        self.digest = 0
        self.on_issue = on_issue      # (op, request ids) as each op is issued: tracing
        self.dropped_pages = 0

    def note(self, *decision: object) -> None:
        """Fold one cache decision into the running digest (62 bits, so -digest fits)."""
        h = hashlib.blake2b(repr((self.digest, decision)).encode(), digest_size=8).digest()
        self.digest = int.from_bytes(h, "little") >> 2

    @contextmanager
    def holding(self, node: Node | None) -> Iterator[None]:
        """Pin `node`'s path while making room, so eviction cannot take what the caller holds."""
        self.tree.pin(node)
        try:
            yield
        finally:
            self.tree.pin(node, -1)

    # -- allocation --------------------------------------------------------------------------

    def alloc_device(self, n: int) -> list[int] | None:
        """`n` device pages, evicting LRU leaves; None if that is not possible this step."""
        alloc = self.device.alloc
        while alloc.free < n:
            for node in self.tree.lru_device_leaves():
                if node.host is not None:
                    self.note("evict-device", node.id)
                    alloc.release(self.tree.evict_device(node))
                    break
                if self.config.write_policy in WRITE_ON_EVICT and self.write(node):
                    break       # locked until its write retires; the next pass tries other leaves
                if self.tree.removable(node):
                    self.note("drop", node.id)
                    self._drop(node)
                    break
            else:
                return None
        self.note("alloc-device", n)
        return alloc.alloc(n)

    def alloc_host(self, n: int) -> list[int] | None:
        alloc = self.host.alloc
        while alloc.free < n:
            node = next(self.tree.lru_host_leaves(), None)
            if node is None:
                return None
            self.note("evict-host", node.id)
            self._drop(node)
        self.note("alloc-host", n)
        return alloc.alloc(n)

    def _drop(self, node: Node) -> None:
        device, host = self.tree.remove(node)
        self.dropped_pages += len(device) + len(host)
        self.device.alloc.release(device)
        self.host.alloc.release(host)

    # -- ops --------------------------------------------------------------------------------

    def write(self, node: Node) -> bool:
        """Back a device node up to the host (L1 -> L2). False if the host has no room."""
        pages = self.alloc_host(node.num_pages)
        if pages is None:
            return False
        self.note("write", node.id, node.num_pages)
        events = self.copier.write(node.device, pages)
        self.tree.set_host(node, pages)
        self.tree.pin(node)
        op = CacheOp("write", node, events, node.num_pages, node.num_pages * self.host.layout.page_bytes,
                     hashes=list(node.hashes), host_pages=list(pages))
        self.on_issue(op, [])
        self.writes.push(op)
        return True

    def load(self, nodes: list[Node], device_pages: list[int], request_id: int) -> CacheOp:
        """Bring host-only nodes back to the device (L2 -> L1), layer by layer."""
        host_pages = [p for n in nodes for p in n.host]
        self.note("load", nodes[0].id, len(host_pages))
        events = self.copier.load(host_pages, device_pages)
        i = 0
        for n in nodes:
            self.tree.set_device(n, device_pages[i: i + n.num_pages])
            i += n.num_pages
        self.tree.pin(nodes[-1])
        op = CacheOp("load", nodes[-1], events, len(host_pages),
                     len(host_pages) * self.host.layout.page_bytes)
        self.on_issue(op, [request_id])
        self.loads.push(op)
        return op

    def release_op(self, op: CacheOp) -> None:
        """Retire a write or load: its pages may be evicted again."""
        self.tree.pin(op.node, -1)

    # -- requests ---------------------------------------------------------------------------

    def match(self, tokens: list[int]) -> Match:
        match = self.tree.match_prefix(tokens)
        if match.host_nodes and match.host_tokens < self.config.load_back_threshold * self.config.page_size:
            match.host_nodes = []
        if self.config.write_policy == "write_through_selective":
            with self.holding(match.last_node):   # making host room must keep the hits
                for node in match.device_nodes:
                    if node.hits >= 2 and node.host is None:
                        self.write(node)
        return match

    def insert(self, tokens: list[int], pages: list[int], hashes: list[str]) -> list[int]:
        """Cache a finished sequence's full pages; returns the caller's pages to free."""
        inserted = self.tree.insert(tokens, pages, hashes)
        self.note("insert", inserted.last.id, len(inserted.duplicate_pages))
        if self.config.write_policy == "write_through":
            for node in inserted.new_nodes:
                self.write(node)
        return inserted.duplicate_pages

    def close(self) -> None:
        self.copier.close()
