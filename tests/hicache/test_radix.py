"""Radix tree invariants under random operation sequences (hypothesis), plus direct cases."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from hicache_async.hicache.radix import RadixTree
from hicache_async.pools import PageAllocator

PS = 2


def test_match_splits_and_reports_tiers():
    tree = RadixTree(PS)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12], ["a", "b", "c"])
    match = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert match.device_pages == [10, 11] and match.device_tokens == 4 and not match.host_nodes
    upper = match.device_nodes[-1]
    lower = next(iter(upper.children.values()))
    tree.set_host(upper, [7, 8])
    tree.set_host(lower, [9])
    tree.evict_device(lower)
    match = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.device_tokens == 4 and match.host_tokens == 2
    tree.evict_device(upper)
    match = tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert match.device_tokens == 0 and match.host_tokens == 6


def test_insert_returns_duplicates_and_adopts_host_only_nodes():
    tree = RadixTree(PS)
    tree.insert([1, 2, 3, 4], [0, 1], ["a", "b"])
    assert tree.insert([1, 2, 3, 4, 5, 6], [5, 6, 7], ["a", "b", "c"]).duplicate_pages == [5, 6]
    tree = RadixTree(PS)
    tree.insert([1, 2, 3, 4], [0, 1], ["a", "b"])
    node = tree.match_prefix([1, 2, 3, 4]).device_nodes[-1]
    tree.set_host(node, [3, 4])
    tree.evict_device(node)
    assert tree.insert([1, 2, 3, 4], [8, 9], ["a", "b"]).duplicate_pages == []
    assert tree.match_prefix([1, 2, 3, 4]).device_pages == [8, 9]


def test_locks_cover_split_halves():
    tree = RadixTree(PS)
    last = tree.insert([1, 2, 3, 4], [0, 1], ["a", "b"]).last
    tree.lock_device(last)
    tree.match_prefix([1, 2, 9, 9])        # splits the locked node
    assert all(n.device_lock == 1 for n in tree.nodes.values())
    tree.lock_device(last, -1)
    assert all(n.device_lock == 0 for n in tree.nodes.values())


def test_leaf_iteration_refuses_to_resume_after_a_leaf_is_re_keyed():
    tree = RadixTree(PS)
    tree.insert([1, 2], [0], ["a"])
    tree.insert([3, 4], [1], ["b"])
    leaves = tree.lru_device_leaves()
    assert next(leaves).tokens == (1, 2)
    tree.match_prefix([1, 2])             # now most recent: its heap entry moves
    with pytest.raises(RuntimeError, match="re-filed"):
        next(leaves)
    assert [n.tokens for n in tree.lru_device_leaves()] == [(3, 4), (1, 2)]


class TreeMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, writes, loads, grafts and evictions against real page
    allocators, over three tenants' trees (no salt, "a", "b") sharing the pools. Locks are
    tracked here too, so eviction is checked against an independent record of what is held,
    not against the lock counts it filters on."""

    inserted = Bundle("inserted")
    salts = st.sampled_from([None, "a", "b"])
    paths = st.one_of(inserted, st.tuples(salts, st.lists(st.integers(0, 2), max_size=5 * PS)))  # replays end on leaves

    def __init__(self):
        super().__init__()
        self.tree = RadixTree(PS)
        self.device = PageAllocator(24, "device")
        self.host = PageAllocator(24, "host")
        self.locked: list = []      # (kind, node): "device", "host" or "pin"

    def _lock(self, kind, node, delta=1):
        {"device": self.tree.lock_device, "host": self.tree.lock_host, "pin": self.tree.pin}[kind](node, delta)

    def _held(self, *kinds) -> set[int]:
        """Ids of nodes on the path of a live lock of one of `kinds`."""
        return {n.id for kind, node in self.locked if kind in kinds for n in self.tree.path_to(node)}

    def _subtree(self, node) -> list:
        out, stack = [], [node]
        while stack:
            out.append(stack.pop())
            stack.extend(out[-1].children.values())
        return out

    def _remove(self, node):
        held = self._held("device", "host", "pin")
        assert not any(n.id in held for n in self._subtree(node)), f"removing a held subtree at {node}"
        device, host = self.tree.remove(node)
        self.device.release(device)
        self.host.release(host)

    @rule(target=inserted, salt=salts, seq=st.lists(st.integers(0, 2), min_size=PS, max_size=5 * PS))
    def insert(self, salt, seq):
        n = len(seq) // PS
        if n <= self.device.free:
            pages = self.device.alloc(n)
            result = self.tree.insert(seq, pages, [str(seq[: (i + 1) * PS]) for i in range(n)], salt)
            self.device.release(result.duplicate_pages)
        return salt, seq

    @rule(path=paths, kind=st.sampled_from(["device", "host", "pin"]))
    def match_and_lock(self, path, kind):
        salt, seq = path
        match = self.tree.match_prefix(seq, salt)
        assert all(n.salt == salt for n in match.device_nodes + match.host_nodes), "a match across tenants"
        if match.last_node is None or (kind == "device" and match.host_nodes):
            return
        self._lock(kind, match.last_node)
        self.locked.append((kind, match.last_node))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        kind, node = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self._lock(kind, node, -1)

    @rule()
    def write_one(self):
        for node in self.tree.nodes.values():
            if node.device is not None and node.host is None and node.num_pages <= self.host.free:
                self.tree.set_host(node, self.host.alloc(node.num_pages))
                return

    @rule(path=paths)
    def load(self, path):
        match = self.tree.match_prefix(path[1], path[0])
        need = match.host_tokens // PS
        if match.host_nodes and need <= self.device.free:
            pages = self.device.alloc(need)
            for node in match.host_nodes:
                self.tree.set_device(node, pages[: node.num_pages])
                pages = pages[node.num_pages:]

    @rule(target=inserted, path=paths)
    def graft(self, path):
        salt, seq = path
        n = len(seq) // PS
        match = self.tree.match_prefix(seq, salt)
        first = (match.device_tokens + match.host_tokens) // PS
        if first < n <= first + self.host.free:
            pages = self.host.alloc(n - first)
            hashes = [str(seq[: (i + 1) * PS]) for i in range(n)]
            self.host.release(self.tree.graft_host(seq, first, hashes, pages, salt))
        return path

    @rule()
    def evict_device(self):
        """Evict the LRU device leaf there is host room for, backing it up first if need be."""
        for node in self.tree.lru_device_leaves():
            if node.host is None:
                if node.num_pages > self.host.free:
                    continue
                self.tree.set_host(node, self.host.alloc(node.num_pages))
            assert node.id not in self._held("device", "pin"), f"evicting device-locked {node}"
            self.device.release(self.tree.evict_device(node))
            return

    @rule()
    def drop_device_leaf(self):
        for node in self.tree.lru_device_leaves():
            if self.tree.removable(node):
                self._remove(node)
                return

    @rule()
    def evict_host(self):
        node = next(self.tree.lru_host_leaves(), None)
        if node is not None:
            self._remove(node)

    @invariant()
    def every_node_lives_under_its_tenants_root(self):
        for node in self.tree.nodes.values():
            root = node
            while root.parent is not None:
                root = root.parent
            assert root is self.tree.tenant_root(node.salt) and root.id not in self.tree.nodes

    @invariant()
    def locks_never_negative(self):
        assert all(n.device_lock >= 0 and n.host_lock >= 0 for n in self.tree.nodes.values())

    @invariant()
    def locked_nodes_stay(self):
        for kind, node in self.locked:
            assert node.id in self.tree.nodes
            if kind == "device":
                assert all(n.device is not None for n in self.tree.path_to(node))

    @invariant()
    def leaf_sets_match_a_full_scan(self):
        nodes = self.tree.nodes.values()
        device = [n for n in nodes if n.device is not None and n.device_lock == 0
                  and not any(c.device is not None for c in n.children.values())]
        host = [n for n in nodes if n.device is None and n.host is not None and n.host_lock == 0
                and not n.children]
        lru = lambda n: (n.last_access, n.id)    # noqa: E731
        assert list(self.tree.lru_device_leaves()) == sorted(device, key=lru)
        assert list(self.tree.lru_host_leaves()) == sorted(host, key=lru)

    @invariant()
    def removable_means_nothing_below_is_locked(self):
        for node in self.tree.nodes.values():
            assert self.tree.removable(node) == all(
                n.device_lock == 0 and n.host_lock == 0 for n in self._subtree(node))

    @invariant()
    def residency_matches_pools(self):
        device = [p for n in self.tree.nodes.values() for p in (n.device or ())]
        host = [p for n in self.tree.nodes.values() for p in (n.host or ())]
        assert len(device) == len(set(device)) and len(host) == len(set(host))
        assert len(device) + self.device.free == self.device.num_pages
        assert len(host) + self.host.free == self.host.num_pages
        for n in self.tree.nodes.values():
            assert n.device is not None or n.host is not None
            if n.device is not None:
                assert all(a.device is not None for a in self.tree.path_to(n))


TestTree = TreeMachine.TestCase
TestTree.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
