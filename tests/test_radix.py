"""Radix tree invariants under random operation sequences (hypothesis), plus direct cases."""
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicache_async.pool import PageAllocator
from hicache_async.radix import RadixTree

PS = 2


def test_match_splits_and_reports_tiers():
    tree = RadixTree(PS)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12], ["a", "b", "c"])
    match = tree.match_prefix([1, 2, 3, 4, 9, 9])
    assert match.device_pages == [10, 11] and match.device_tokens == 4 and not match.host_nodes
    upper = match.device_nodes[-1]
    lower = next(iter(upper.children.values()))
    upper.host, lower.host = [7, 8], [9]
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
    node.host = [3, 4]
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


class TreeMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, writes and evictions against real page allocators."""

    def __init__(self):
        super().__init__()
        self.tree = RadixTree(PS)
        self.device = PageAllocator(24, "device")
        self.host = PageAllocator(24, "host")
        self.locked: list = []

    @rule(seq=st.lists(st.integers(0, 2), min_size=PS, max_size=5 * PS))
    def insert(self, seq):
        n = len(seq) // PS
        if n > self.device.free:
            return
        pages = self.device.alloc(n)
        result = self.tree.insert(seq, pages, [str(seq[: (i + 1) * PS]) for i in range(n)])
        self.device.release(result.duplicate_pages)

    @rule(seq=st.lists(st.integers(0, 2), max_size=5 * PS))
    def match_and_lock(self, seq):
        match = self.tree.match_prefix(seq)
        if match.device_nodes and not match.host_nodes:
            self.tree.lock_device(match.last_node)
            self.locked.append(match.last_node)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        node = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.tree.lock_device(node, -1)

    @rule()
    def write_one(self):
        for node in self.tree.nodes.values():
            if node.device is not None and node.host is None and node.num_pages <= self.host.free:
                node.host = self.host.alloc(node.num_pages)
                return

    @rule()
    def evict_device(self):
        leaves = self.tree.device_leaves()
        for node in leaves:
            assert node.device_lock == 0
            if node.host is not None:
                self.device.release(self.tree.evict_device(node))
                return

    @rule()
    def evict_host(self):
        leaves = self.tree.host_leaves()
        if leaves:
            device, host = self.tree.remove(leaves[0])
            self.device.release(device)
            self.host.release(host)

    @invariant()
    def locks_never_negative(self):
        assert all(n.device_lock >= 0 and n.host_lock >= 0 for n in self.tree.nodes.values())

    @invariant()
    def locked_nodes_stay_on_device(self):
        for node in self.locked:
            assert all(n.device is not None for n in self.tree.path_to(node))

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
