"""The L1/L2 tier state machine: allocation with eviction, and the write/load ops it issues.

Every decision here is a pure function of the tree and the pools, both of which change
only through calls made in the same order on every rank, so ranks stay identical. Each
decision is folded into the ledger's digest, which the agreement compares across ranks.
Ops go into the step ledger; the plugin hands back the ones every rank retired.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..config import CacheConfig
from ..kinds import TransferKind
from ..pools import DevicePool, HostPool
from ..topology import RankCoords
from ..transfer.copier import Copier
from .ledger import Ledger
from .node import Node
from .op_tracing import OpTracer
from .ops import CacheOp
from .page_history import PageHistory
from .radix import Match, RadixTree

WRITE_ON_EVICT = ("write_back", "write_through_selective")


@dataclass
class Admitted:
    """A request's side of an admission: its device pages (cached prefix first), the node its
    prefix lock holds, the load its first forward waits on, and each cached page's tier."""

    pages: list[int]
    lock: Node | None
    load: CacheOp | None
    origin: list[str]


class TieredCache:
    def __init__(self, config: CacheConfig, device: DevicePool, host: HostPool,
                 ledger: Ledger | None = None) -> None:
        self.config = config
        self.device, self.host = device, host
        self.tree = RadixTree(config.page_size)
        self.copier = Copier(device, host)
        self.ledger = ledger or Ledger(OpTracer("local", RankCoords(), config.key_scheme),
                                       timeout_s=config.sync_timeout_s)   # a cache used alone
        self.note = self.ledger.note
        self.tracer = self.ledger.tracer
        self.dropped_pages = 0
        # What became of every page ever cached, to name why a miss happened: the planner's
        # account (a modelled clock), never kept by an engine serving for real, where it would grow
        # with every page and cost a hash chain per missed admission.
        self.history = PageHistory() if self.ledger.clock.modelled else None

    # -- requests ---------------------------------------------------------------------------

    def match(self, tokens: list[int], salt: str | None = None) -> Match:
        """The cached prefix of `tokens` in tenant `salt`'s tree."""
        match = self.tree.match_prefix(tokens, salt)
        if match.host_nodes and match.host_tokens < self.config.load_back_threshold * self.config.page_size:
            match.host_nodes = []
        if self.config.write_policy == "write_through_selective":
            with self._holding(match.last_node):   # making host room must keep the hits
                for node in match.device_nodes:
                    if node.hits >= 2 and node.host is None:
                        self.write(node)
        return match

    def admit(self, match: Match, pages: int, request_id: int) -> Admitted | None:
        """`pages` device pages for a request whose cached prefix is `match`: the device hits,
        then fresh pages, the first of which the host hits are loaded into. The prefix stays
        locked on the device until `finish`. None if there is no room this step."""
        lock, hits = match.last_node, match.device_pages
        fresh = self.alloc_device(pages - len(hits), keep=lock)
        if fresh is None:
            return None
        self.tree.lock_device(lock)
        origin, load = ["l1"] * len(hits), None
        if match.host_nodes:
            load = self._load(match.host_nodes, fresh[: match.host_tokens // self.config.page_size], request_id)
            for n in match.host_nodes:      # a page fetched from L3 counts as L3 at its first use
                origin += ["l3" if n.fetched else "l2"] * n.num_pages
                n.fetched = False
        return Admitted(hits + fresh, lock, load, origin)

    def finish(self, tokens: list[int], pages: list[int], hashes: list[str], lock: Node | None,
               salt: str | None = None) -> None:
        """Cache a finished request's full pages (`tokens` spans exactly them) in its tenant's
        tree, free the rest of its `pages`, and unlock the prefix its admission locked."""
        full = len(tokens) // self.config.page_size
        self.free_device(self.insert(tokens, pages[:full], hashes, salt) + pages[full:])
        self.tree.lock_device(lock, -1)

    def insert(self, tokens: list[int], pages: list[int], hashes: list[str], salt: str | None = None) -> list[int]:
        """Cache a sequence's full pages; returns the caller's pages to free."""
        inserted = self.tree.insert(tokens, pages, hashes, salt)
        if self.history is not None:
            self.history.inserted(hashes[: len(tokens) // self.config.page_size])
        self.note("insert", inserted.last.id, len(inserted.duplicate_pages))
        if self.config.write_policy == "write_through":
            for node in inserted.new_nodes:
                self.write(node)
        return inserted.duplicate_pages

    # -- allocation --------------------------------------------------------------------------

    def alloc_device(self, n: int, keep: Node | None = None) -> list[int] | None:
        """`n` device pages, evicting LRU leaves but not `keep`'s path; None if that is not
        possible this step. `free_device` gives them back."""
        alloc = self.device.alloc
        with self._holding(keep):
            while alloc.free < n:
                if not self._evict_device():
                    return None
        self.note("alloc-device", n)
        return alloc.alloc(n)

    def free_device(self, pages: list[int]) -> None:
        self.device.alloc.release(pages)

    def alloc_host(self, n: int, keep: Node | None = None) -> list[int] | None:
        alloc = self.host.alloc
        with self._holding(keep):
            while alloc.free < n:
                node = next(self.tree.lru_host_leaves(), None)
                if node is None:
                    return None
                self.note("evict-host", node.id)
                self._drop(node)
        self.note("alloc-host", n)
        return alloc.alloc(n)

    def free_host(self, pages: list[int]) -> None:
        self.host.alloc.release(pages)

    def _evict_device(self) -> bool:
        """Free device pages by one eviction step; False if no leaf can give any up."""
        for node in self.tree.lru_device_leaves():
            if node.host is not None:
                self.note("evict-device", node.id)
                self.free_device(self.tree.evict_device(node))
                return True
            if self.config.write_policy in WRITE_ON_EVICT and self.write(node):
                return True     # locked until its write retires; the next pass tries other leaves
            if self.tree.removable(node):
                self.note("drop", node.id)
                self._drop(node)
                return True
        return False

    def _drop(self, node: Node) -> None:
        device, host = self.tree.remove(node)
        self.dropped_pages += len(device) + len(host)
        self.free_device(device)
        self.free_host(host)

    @contextmanager
    def _holding(self, node: Node | None) -> Iterator[None]:
        """Pin `node`'s path while making room, so eviction cannot take what the caller holds."""
        self.tree.pin(node)
        try:
            yield
        finally:
            self.tree.pin(node, -1)

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
        self.ledger.issue(CacheOp(TransferKind.WRITE, node, events, node.num_pages,
                                  node.num_pages * self.host.layout.page_bytes,
                                  hashes=list(node.hashes), host_pages=list(pages)))
        return True

    def _load(self, nodes: list[Node], device_pages: list[int], request_id: int) -> CacheOp:
        """Bring host-only nodes back to the device (L2 -> L1), layer by layer."""
        host_pages = [p for n in nodes for p in n.host]
        self.note("load", nodes[0].id, len(host_pages))
        events = self.copier.load(host_pages, device_pages)
        i = 0
        for n in nodes:
            self.tree.set_device(n, device_pages[i: i + n.num_pages])
            i += n.num_pages
        self.tree.pin(nodes[-1])
        op = CacheOp(TransferKind.LOAD, nodes[-1], events, len(host_pages),
                     len(host_pages) * self.host.layout.page_bytes)
        self.ledger.issue(op, [request_id])
        return op

    # -- retirement -------------------------------------------------------------------------

    def retired(self, ops: list[CacheOp]) -> None:
        """Writes and loads every rank retired: their pages may be evicted again."""
        for op in ops:
            self.tree.pin(op.node, -1)

    def close(self) -> None:
        self.copier.close()

