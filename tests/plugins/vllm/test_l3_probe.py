"""The scheduler's L3 probe over real stores: a miss is told at once, a stored page never is."""
import dataclasses

import pytest

from hicache_async.config import CacheConfig
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.pools import HostPool
from hicache_async.storage import open_storage
from hicache_async.topology import RankCoords
from hicache_async.transfer.page_store import PageStore
from hicache_vllm.l3_probe import L3Probe, key_suffixes, open_probe
from tests.helpers.small_pages import LAYOUT, seeded_host

STORED, UNSEEN = page_hashes(range(8), 4)


def _worker_store(adapter, scheme: str, coords: RankCoords = RankCoords()) -> PageStore:
    layout = LAYOUT
    if coords.tp_size > 1:      # this rank's half of LAYOUT's two kv heads
        layout = dataclasses.replace(LAYOUT, kv_heads=1, first_head=coords.tp_rank, total_kv_heads=2)
    return PageStore(adapter, layout, make_key_scheme(scheme, layout, coords), coords)


@pytest.mark.parametrize("scheme", ["rank-suffix", "unified"])
def test_a_page_no_worker_stored_is_absent_and_a_stored_one_is_not(tmp_path, scheme):
    store = _worker_store(open_storage("file", path=str(tmp_path)), scheme)
    assert store.backup([STORED], seeded_host(), [0]).ok == [True]
    probe = L3Probe(open_storage("file", path=str(tmp_path)), workers=1)
    probe.learn(0, key_suffixes(store.keys))
    assert not probe.absent(STORED)
    assert probe.absent(UNSEEN)
    # what the probe calls present, a prefetch reads: every object of the page is there
    assert store.stored_run([STORED]) == 1 and store.stored_run([UNSEEN]) == 0


def test_a_page_one_worker_lacks_is_absent_and_nothing_is_said_before_every_worker_reported(tmp_path):
    adapter = open_storage("file", path=str(tmp_path))
    ranks = [_worker_store(adapter, "rank-suffix", RankCoords(tp_rank=r, tp_size=2)) for r in range(2)]
    host = HostPool(ranks[0].layout, 2)
    assert ranks[0].backup([STORED], host, [0]).ok == [True]      # rank 1 never wrote its half
    probe = L3Probe(adapter, workers=2)
    probe.learn(0, key_suffixes(ranks[0].keys))
    assert not probe.absent(STORED) and not probe.absent(UNSEEN)   # rank 1 not reported: maybe
    probe.learn(1, key_suffixes(ranks[1].keys))
    assert probe.absent(STORED) and probe.absent(UNSEEN)
    assert ranks[1].backup([STORED], host, [1]).ok == [True]
    assert not probe.absent(STORED)


def test_a_failing_store_says_nothing_so_the_prefetch_decides():
    adapter = open_storage("memory")
    probe = L3Probe(adapter, workers=1)
    probe.learn(0, ["_x"])
    assert probe.absent(UNSEEN)
    adapter.close()
    assert not probe.absent(UNSEEN)


def test_open_probe_reads_the_workers_file_store_through_its_own_session(tmp_path):
    options = {"storage_path": str(tmp_path / "l3")}
    with open_probe("file", options, CacheConfig(), workers=1) as probe:
        store = _worker_store(open_storage("file", path=options["storage_path"]), "unified")
        probe.learn(0, key_suffixes(store.keys))
        assert probe.absent(STORED)
        assert store.backup([STORED], seeded_host(), [0]).ok == [True]
        assert not probe.absent(STORED)
