"""Checksum placement: inline (small machines) and pooled (spare cores) give the same objects."""
import threading
import time

import pytest
import torch

from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.pools import HostPool
from hicache_async.storage.file import FileStorage
from hicache_async.storage.memory import MemoryStorage
from hicache_async.transfer import checksums
from hicache_async.transfer.page_store import PageStore
from tests.helpers.layouts import LAYOUT


@pytest.fixture(params=[0, 2], ids=["inline", "pooled"])
def workers(request, monkeypatch):
    monkeypatch.setattr(checksums, "CHECKSUM_WORKERS", request.param)
    monkeypatch.setattr(checksums, "GROUP_BYTES", 40)    # small groups: several per batch
    monkeypatch.setattr(checksums, "HOT_BYTES", 40)
    monkeypatch.setattr(checksums, "AHEAD_BYTES", 100)
    return request.param


def test_ahead_runs_each_group_once_before_its_items_are_used(workers):
    done, lock = [], threading.Lock()

    def work(group):
        with lock:
            done.append(group)

    ahead = checksums.Ahead([10] * 20, work)     # groups of 4 items
    for i in (0, 1, 5, 19):
        ahead.wait(i)
        assert any(i in g for g in done)
    assert len(set(done)) == len(done)
    assert ahead.used == [i in (0, 1, 5, 19) for i in range(20)]
    # Inline, only the groups asked for; pooled, also up to AHEAD_BYTES beyond each one asked
    # for: 8..12 with the first, 12..16 with item 5's.
    ahead_of_first = [range(8, 12), range(12, 16)] if workers else []
    deadline = time.monotonic() + 10
    while len(done) < 3 + len(ahead_of_first) and time.monotonic() < deadline:
        time.sleep(0.01)                       # work run ahead lands on the pool in its own time
    assert sorted(done, key=lambda g: g.start) == [range(0, 4), range(4, 8), *ahead_of_first, range(16, 20)]


def test_behind_takes_results_in_pieces_and_ignores_late_ones(workers):
    behind = checksums.Behind([10] * 10, lambda group, got: (group, got))
    behind.landed(0, [1, 2, 3])
    behind.landed(3, [4, 5, 6, 7, 8])
    outcomes = behind.finish([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert [got for _, got in outcomes] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    ran = []
    failed = checksums.Behind([10] * 4, lambda group, got: ran.append(got))
    failed.landed(0, [1, 2])
    failed.abandon()
    failed.landed(2, [3, 4])                    # an abandoned call reporting late: ignored
    time.sleep(0.05)                            # pooled work would have landed by now
    assert ran == []


def test_a_batch_that_lands_at_once_is_checked_in_one_pass_inline_and_in_groups_on_a_pool(workers):
    """An adapter that does not land each object hands every result over as its call returns:
    inline, the checks are then one pass with no hand-off per group; a pool still shares them."""
    behind = checksums.Behind([10] * 10, lambda group, got: (group, got), each=False)
    outcomes = behind.finish(list(range(10)))
    expected = [range(0, 4), range(4, 8), range(8, 10)] if workers else [range(0, 10)]
    assert [group for group, _ in outcomes] == expected
    assert [n for _, got in outcomes for n in got] == list(range(10))


def test_page_store_round_trip_is_the_same_either_way(workers):
    host = HostPool(LAYOUT, 8)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(1)))
    store = PageStore(MemoryStorage(), LAYOUT, make_key_scheme("unified", LAYOUT, head_group=1))
    hashes = page_hashes(range(8 * 4), 4)
    stored = store.backup(hashes, host, list(range(8)))
    assert stored.ok == [True] * 8 and stored.skipped == 0
    reader = HostPool(LAYOUT, 8)
    got = store.prefetch(hashes, reader, list(range(7, -1, -1)))
    assert (got.pages, got.corrupt, got.missing) == (8, 0, 0)
    assert torch.equal(reader.tensor.flip(0), host.tensor)


def test_in_place_checks_each_object_as_it_lands_until_one_fails():
    checked = []

    def check(i, n):
        checked.append(i)
        return "corrupt" if n == 0 else None
    in_place = checksums.InPlace(check)
    in_place.landed(0, [7])
    in_place.landed(1, [7, 7])
    in_place.landed(3, [0, 7])                  # object 3 fails: the run ends there, unchecked beyond
    in_place.landed(5, [7])
    assert in_place.finish([7, 7, 7, 0, 7, 7]) == [([7, 7, 7], "corrupt")]
    assert checked == [0, 1, 2, 3]
    unreported = checksums.InPlace(check)       # an adapter that reports nothing: checked at finish
    assert unreported.finish([7, 7]) == [([7, 7], None)]


def test_in_place_checks_stop_once_the_caller_gave_up():
    checked = []
    in_place = checksums.InPlace(lambda i, n: checked.append(i))
    in_place.landed(0, [7, 7])
    in_place.abandon()
    in_place.landed(2, [7])
    assert checked == [0, 1]


def test_a_direct_read_stops_at_the_first_bad_object_either_way(workers, tmp_path):
    """Whole pages read in place: checked inline as they land (InPlace) or on a pool (Behind),
    a flipped byte ends the verified run at its page, and the pages before it are exact."""
    host = HostPool(LAYOUT, 8)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(2)))
    keys = make_key_scheme("rank-suffix", LAYOUT)
    store = PageStore(FileStorage(str(tmp_path)), LAYOUT, keys)
    hashes = page_hashes(range(8 * 4), 4)
    assert store.backup(hashes, host, list(range(8))).ok == [True] * 8
    path = store.adapter._path(keys.objects(hashes[5])[0].key)
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    reader = HostPool(LAYOUT, 8)
    got = store.prefetch(hashes, reader, list(range(8)))
    assert (got.pages, got.corrupt, got.missing) == (5, 1, 0)
    assert torch.equal(reader.tensor[:5], host.tensor[:5])
