import threading

import pytest
import torch

from hicache_async.errors import UsageError
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.pools import HostPool
from hicache_async.storage.file import FileStorage
from hicache_async.storage.memory import MemoryStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer.page_store import PageStore
from tests.helpers.fake_storages import DownStorage
from tests.helpers.layouts import TOTAL_HEADS, TOTAL_LAYERS, grid, rank_layout
from tests.helpers.round_trips import assert_concurrent_round_trips

PAGES = 5
HASHES = page_hashes(range(PAGES * 4), 4)


def global_kv(attention="mha", seed=0):
    """Every page's KV for the whole model: [page, layer, planes, tokens, heads, dim]."""
    planes, heads = (2, TOTAL_HEADS) if attention == "mha" else (1, 1)
    return torch.randn((PAGES, TOTAL_LAYERS, planes, 4, heads, 4), generator=torch.Generator().manual_seed(seed))


def rank_view(kv, layout):
    return kv[:, layout.first_layer:layout.last_layer + 1, :, :, layout.first_head:layout.last_head + 1]


def write(storage, kv, tp, pp, cp=1, scheme="unified", attention="mha", cp_mode="split", head_group=1):
    results = []
    for c in grid(tp, pp, cp):
        layout = rank_layout(c, attention)
        host = HostPool(layout, PAGES + 2)
        host.tensor[2:] = rank_view(kv, layout)       # pages live at host slots 2..
        store = PageStore(storage, layout, make_key_scheme(scheme, layout, c, head_group), c, cp_mode)
        results.append(store.backup(HASHES, host, list(range(2, PAGES + 2))))
    return results


def read(storage, kv, tp, pp, cp=1, scheme="unified", attention="mha", head_group=1):
    """Prefetch on every rank; the leading page counts, after checking the bytes bitwise.

    A page another topology stored must miss, never fail verification: no object may be
    corrupt (named like ours but holding other bytes) or vanish between probe and read."""
    counts = []
    for c in grid(tp, pp, cp):
        layout = rank_layout(c, attention)
        host = HostPool(layout, PAGES)
        store = PageStore(storage, layout, make_key_scheme(scheme, layout, c, head_group), c)
        got = store.prefetch(HASHES, host, list(range(PAGES - 1, -1, -1)))   # reversed slots
        assert (got.corrupt, got.missing, got.errors) == (0, 0, 0), (tp, pp, cp, c)
        assert torch.equal(host.tensor.flip(0)[:got.pages], rank_view(kv, layout)[:got.pages])
        counts.append(got.pages)
    return counts


@pytest.mark.parametrize("writer,readers", [((2, 1), [(1, 1), (4, 1)]), ((1, 2), [(1, 1), (1, 4)]),
                                            ((2, 2), [(4, 1), (1, 1)])])
def test_unified_objects_serve_other_topologies(writer, readers):
    storage, kv = MemoryStorage(), global_kv()
    assert all(r.ok == [True] * PAGES for r in write(storage, kv, *writer))
    for tp, pp in readers:
        assert read(storage, kv, tp, pp) == [PAGES] * (tp * pp)


def test_unified_head_groups_serve_other_topologies_on_file(tmp_path):
    storage, kv = FileStorage(str(tmp_path)), global_kv()
    write(storage, kv, 2, 1, head_group=2)
    assert read(storage, kv, 1, 2, head_group=2) == [PAGES] * 2
    assert read(storage, kv, 1, 1, head_group=1) == [0]   # another grouping misses, never misreads


def test_unified_mla_written_once_read_by_every_tp_rank():
    storage, kv = MemoryStorage(), global_kv("mla")
    write(storage, kv, 2, 1, attention="mla")
    assert len(storage._objects) == PAGES * TOTAL_LAYERS
    assert read(storage, kv, 4, 1, attention="mla") == [PAGES] * 4


def test_rank_suffix_other_topology_misses_instead_of_misreading():
    storage, kv = MemoryStorage(), global_kv()
    write(storage, kv, 2, 1, scheme="rank-suffix")
    assert read(storage, kv, 2, 1, scheme="rank-suffix") == [PAGES] * 2
    assert read(storage, kv, 1, 1, scheme="rank-suffix") == [0]   # tp rank 0 of 1 holds other heads


@pytest.mark.parametrize("backend", ["memory", "file"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_rank_suffix_topologies_share_one_storage(backend, attention, tmp_path):
    """TP1, TP2, PP2 and PP4 back up the same pages into one storage; each reads all of its own."""
    storage, kv = (MemoryStorage() if backend == "memory" else FileStorage(str(tmp_path))), global_kv(attention)
    layouts = [(1, 1), (2, 1), (1, 2), (1, 4)]
    for tp, pp in layouts:
        assert all(r.ok == [True] * PAGES for r in write(storage, kv, tp, pp, scheme="rank-suffix",
                                                         attention=attention))
    for tp, pp in layouts:
        assert read(storage, kv, tp, pp, scheme="rank-suffix", attention=attention) == [PAGES] * (tp * pp)


def test_rank_suffix_mla_latent_serves_every_tp_size():
    """The latent does not depend on tp, so its keys do not either: TP1 writes, TP4 reads."""
    storage, kv = MemoryStorage(), global_kv("mla")
    write(storage, kv, 1, 2, scheme="rank-suffix", attention="mla")
    assert read(storage, kv, 4, 2, scheme="rank-suffix", attention="mla") == [PAGES] * 8


@pytest.mark.parametrize("scheme,attention,expected_objects", [
    ("unified", "mha", PAGES * TOTAL_LAYERS * TOTAL_HEADS),
    ("rank-suffix", "mha", PAGES * 2),      # each CP rank writes its own copy
    ("rank-suffix", "mla", PAGES),          # MLA keys are shared by CP ranks
])
def test_cp_split_writes_each_object_once_and_every_rank_reads_all(scheme, attention, expected_objects):
    storage, kv = MemoryStorage(), global_kv(attention)
    results = write(storage, kv, 1, 1, cp=2, scheme=scheme, attention=attention)
    assert all(r.ok == [True] * PAGES for r in results)
    written = sum(r.bytes for r in results)
    assert len(storage._objects) == expected_objects
    assert written == sum(len(b) for b in storage._objects.values())
    assert read(storage, kv, 1, 1, cp=2, scheme=scheme, attention=attention) == [PAGES] * 2


def test_cp_rank0_mode_leaves_writing_to_rank0():
    storage, kv = MemoryStorage(), global_kv()
    r0, r1 = write(storage, kv, 1, 1, cp=2, cp_mode="rank0")
    assert r1.ok == [True] * PAGES and r1.bytes == 0
    assert r0.bytes == sum(len(b) for b in storage._objects.values())


def test_leading_run_dedupe_and_cancel():
    layout = rank_layout(RankCoords())
    host = HostPool(layout, PAGES)
    host.tensor.copy_(torch.randn(host.tensor.shape))
    store = PageStore(MemoryStorage(), layout, make_key_scheme("rank-suffix", layout, RankCoords()))
    store.backup(HASHES[:2] + HASHES[3:], host, [0, 1, 3, 4])
    assert store.prefetch(HASHES, HostPool(layout, PAGES), list(range(PAGES))).pages == 2
    again = store.backup(HASHES[:2], host, [0, 1])
    assert (again.skipped, again.bytes) == (2, 0)
    cancel = threading.Event()
    cancel.set()
    assert store.prefetch(HASHES, host, list(range(PAGES)), cancel=cancel).pages == 0
    with pytest.raises(ValueError, match="5 page hashes for 4 host pages"):
        store.backup(HASHES, host, [0, 1, 2, 3])
    with pytest.raises(UsageError, match="'all'"):
        PageStore(MemoryStorage(), layout, store.keys, cp_mode="all")


def test_storage_failure_is_counted_not_raised():
    layout = rank_layout(RankCoords())
    host = HostPool(layout, PAGES)
    storage = DownStorage()
    store = PageStore(storage, layout, make_key_scheme("unified", layout, RankCoords()))
    storage.down = True
    backup = store.backup(HASHES, host, list(range(PAGES)))
    assert backup.ok == [False] * PAGES and backup.errors == PAGES * TOTAL_LAYERS * TOTAL_HEADS
    prefetch = store.prefetch(HASHES, host, list(range(PAGES)))
    assert (prefetch.pages, prefetch.errors) == (0, 1)
    assert store.counters.storage_errors == backup.errors + 1
    storage.down = False
    assert store.backup(HASHES, host, list(range(PAGES))).ok == [True] * PAGES


def test_concurrent_backups_and_prefetches(tmp_path):
    layout = rank_layout(RankCoords())
    host = HostPool(layout, 32)
    host.tensor.copy_(torch.randn(host.tensor.shape))
    store = PageStore(FileStorage(str(tmp_path)), layout, make_key_scheme("unified", layout, RankCoords()))
    assert_concurrent_round_trips(store, host, [page_hashes(range(1000 * b, 1000 * b + 16), 4) for b in range(8)], 4)
    assert store.counters.bytes_read == store.counters.bytes_written


@pytest.mark.parametrize("scheme", ["rank-suffix", "unified"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_evicted_pages_are_this_namespaces_of_any_rank_and_no_other(tmp_path, scheme, attention):
    """TP2 stores pages 0-2; a model of other head size stores pages 3-4 beside them. Then every
    object is evicted: a store names pages 0-2, whichever rank's objects went, and not 3-4."""
    fs = FileStorage(str(tmp_path), capacity_bytes=1 << 30)
    kv = global_kv(attention)
    stores = []
    for c in grid(2, 1, 1):
        layout = rank_layout(c, attention)
        host = HostPool(layout, PAGES)
        host.tensor[:] = rank_view(kv, layout)
        store = PageStore(fs, layout, make_key_scheme(scheme, layout, c), c)
        assert all(store.backup(HASHES[:3], host, [0, 1, 2]).ok)
        stores.append(store)
    other = rank_layout(RankCoords(), attention, head_dim=8)
    host = HostPool(other, PAGES)
    assert all(PageStore(fs, other, make_key_scheme(scheme, other)).backup(HASHES[3:], host, [3, 4]).ok)
    fs.capacity_bytes = 1
    assert fs.batch_set(["last"], [b"x"]) == [True]
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]     # "last" too: no page of anyone's
    assert stores[1].evicted_pages() == set(HASHES[:3])
    assert stores[0].evicted_pages() == set()          # told once
