"""Against a real mooncake_master started on free loopback ports (the fixtures in conftest.py)."""
import time

import pytest
import torch
from hicache_mooncake import MooncakeMaster, MooncakeStorage
from hicache_mooncake import adapter as adapter_module
from hicache_mooncake.adapter import _runs
from hicache_async.ports import free_port

from hicache_async.errors import StorageError
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.pools import HostPool
from hicache_async.storage import MISSING, WRONG_SIZE, open_storage
from hicache_async.topology import RankCoords
from hicache_async.transfer import checksums
from hicache_async.transfer.objects import HEADER_BYTES, encode_header
from hicache_async.transfer.page_store import PageStore
from tests.helpers.layouts import rank_layout
from tests.helpers.round_trips import assert_concurrent_round_trips

LAYOUT = rank_layout(RankCoords())


def _host(pages=8, seed=0):
    host = HostPool(LAYOUT, pages)
    host.tensor.copy_(torch.randn(host.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return host


@pytest.mark.parametrize("scheme,head_group,first_token", [("rank-suffix", 1, 0), ("unified", 1, 100),
                                                           ("unified", 2, 200)])
def test_round_trip_through_page_store(mooncake_storage, scheme, head_group, first_token):
    hashes = page_hashes(range(first_token, first_token + 32), 4)
    store = PageStore(mooncake_storage, LAYOUT, make_key_scheme(scheme, LAYOUT, RankCoords(), head_group))
    host = _host()
    assert store.backup(hashes, host, list(range(8))).ok == [True] * 8
    reader = HostPool(LAYOUT, 8)
    got = store.prefetch(hashes, reader, list(range(7, -1, -1)))
    assert (got.pages, got.corrupt, got.errors) == (8, 0, 0)
    assert torch.equal(reader.tensor.flip(0), host.tensor)
    assert store.counters.bytes_read == store.counters.bytes_written == got.bytes


def test_batches_are_one_call_inline_and_small_at_the_edges_when_pooled(monkeypatch):
    sizes = [1 << 20] * 40
    monkeypatch.setattr(adapter_module, "CHECKSUM_WORKERS", 0)
    assert _runs(sizes, small_tail=True) == [range(40)]
    monkeypatch.setattr(adapter_module, "CHECKSUM_WORKERS", 2)
    puts, gets = _runs(sizes, small_tail=False), _runs(sizes, small_tail=True)
    for runs in (puts, gets):
        assert [i for r in runs for i in r] == list(range(40))
    assert (len(puts[0]), len(gets[-1]), max(map(len, puts))) == (2, 2, 8)


def test_pooled_checksums_over_several_calls_round_trip(mooncake_storage, monkeypatch):
    monkeypatch.setattr(checksums, "CHECKSUM_WORKERS", 2)
    monkeypatch.setattr(adapter_module, "CHECKSUM_WORKERS", 2)
    monkeypatch.setattr(adapter_module, "EDGE_BYTES", 1)     # a call per object or two
    monkeypatch.setattr(adapter_module, "RUN_BYTES", 2 * LAYOUT.page_bytes)
    hashes = page_hashes(range(900, 932), 4)
    store = PageStore(mooncake_storage, LAYOUT, make_key_scheme("unified", LAYOUT, RankCoords()))
    host = _host(seed=7)
    assert store.backup(hashes, host, list(range(8))).ok == [True] * 8
    reader = HostPool(LAYOUT, 8)
    got = store.prefetch(hashes, reader, list(range(8)))
    assert (got.pages, got.corrupt, got.errors) == (8, 0, 0) and torch.equal(reader.tensor, host.tensor)


def test_exists_is_the_leading_run_and_get_reports_misses(mooncake_storage):
    assert mooncake_storage.batch_set(["lr-a", "lr-b", "lr-d"], [b"A" * 10, b"B" * 10, b"D" * 10]) == [True] * 3
    assert mooncake_storage.batch_exists(["lr-a", "lr-b", "lr-c", "lr-d"]) == 2
    bufs = [memoryview(bytearray(10)), memoryview(bytearray(10)), memoryview(bytearray(4))]
    assert mooncake_storage.batch_get(["lr-a", "lr-c", "lr-d"], bufs) == [10, MISSING, WRONG_SIZE]
    assert bytes(bufs[0]) == b"A" * 10
    assert mooncake_storage.batch_set(["lr-a"], [b"A" * 10]) == [True]   # already there: fine


def test_opened_by_name(mooncake_master):
    with open_storage("mooncake", master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                      segment_bytes=16 << 20, buffer_bytes=16 << 20) as adapter:
        assert isinstance(adapter, MooncakeStorage)
        assert adapter.batch_exists(["never-stored"]) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_object_is_a_miss_and_counted(mooncake_storage, damage):
    store = PageStore(mooncake_storage, LAYOUT, make_key_scheme("rank-suffix", LAYOUT, RankCoords()))
    h = page_hashes([7, 8, 9, 10 if damage == "flip" else 11], 4)
    spec = store.keys.objects(h[0])[0]
    payload = bytearray(_host().page_bytes(0))
    blob = bytearray(encode_header(spec.key, spec, LAYOUT.namespace(), payload)) + payload
    if damage == "flip":
        blob[HEADER_BYTES + 100] ^= 0x40
    else:
        del blob[-16:]
    assert mooncake_storage.batch_set([spec.key], [bytes(blob)]) == [True]
    got = store.prefetch(h, HostPool(LAYOUT, 1), [0])
    assert (got.pages, got.corrupt, store.counters.corrupt_objects) == (0, 1, 1)


def test_master_killed_mid_run_then_back(tmp_path):
    with MooncakeMaster(log_path=str(tmp_path / "master.log")) as master:
        adapter = MooncakeStorage(master.address, master.metadata_url, segment_bytes=32 << 20,
                                  buffer_bytes=16 << 20)
        try:
            store = PageStore(adapter, LAYOUT, make_key_scheme("unified", LAYOUT, RankCoords()))
            host, batch = _host(), lambda i: page_hashes(range(1000 * i, 1000 * i + 32), 4)
            assert store.backup(batch(0), host, list(range(8))).ok == [True] * 8
            master.stop()
            down = store.backup(batch(1), host, list(range(8)))
            assert down.errors > 0 and not any(down.ok)
            assert store.prefetch(batch(0), host, list(range(8))).errors == 1
            assert store.counters.storage_errors == down.errors + 1
            master.start()                      # same ports
            deadline, i = time.monotonic() + 60, 2
            while store.backup(batch(i), host, list(range(8))).errors:
                assert time.monotonic() < deadline, "no recovery within 60 s of the master's restart"
                time.sleep(0.2)
                i += 1
            reader = HostPool(LAYOUT, 8)
            assert store.prefetch(batch(i), reader, list(range(8))).pages == 8
            assert torch.equal(reader.tensor, host.tensor)
        finally:
            adapter.close()


def test_objects_outlive_the_client_that_wrote_them(mooncake_master):
    hashes = page_hashes(range(7000, 7032), 4)
    host = _host(seed=5)
    with MooncakeStorage(mooncake_master.address, mooncake_master.metadata_url) as writer:
        store = PageStore(writer, LAYOUT, make_key_scheme("unified", LAYOUT, RankCoords()))
        assert store.backup(hashes, host, list(range(8))).ok == [True] * 8
    reader = HostPool(LAYOUT, 8)
    with MooncakeStorage(mooncake_master.address, mooncake_master.metadata_url) as adapter:
        got = PageStore(adapter, LAYOUT, make_key_scheme("unified", LAYOUT, RankCoords())).prefetch(
            hashes, reader, list(range(8)))
    assert (got.pages, got.corrupt) == (8, 0) and torch.equal(reader.tensor, host.tensor)


def test_holder_remounts_after_the_master_restarts(tmp_path):
    with MooncakeMaster(holder_bytes=64 << 20, log_path=str(tmp_path / "master.log")) as master:
        master.kill_master()
        master.start()                          # same ports; only the master was down
        assert master.running()
        with MooncakeStorage(master.address, master.metadata_url) as adapter:
            deadline = time.monotonic() + 60
            while adapter.batch_set(["after-restart"], [b"x" * 100]) != [True]:
                assert time.monotonic() < deadline, "holder segment not re-mounted within 60 s"
                time.sleep(0.2)
            assert adapter.batch_exists(["after-restart"]) == 1


def test_unreachable_master_fails_fast():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StorageError, match=f"127.0.0.1:{port} unreachable"):
        MooncakeStorage(f"127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}/metadata")
    assert time.monotonic() - start < 10


def test_concurrent_calls_from_a_thread_pool(mooncake_storage):
    store = PageStore(mooncake_storage, LAYOUT, make_key_scheme("unified", LAYOUT, RankCoords(), 2))
    batches = [page_hashes(range(5000 + 100 * b, 5000 + 100 * b + 16), 4) for b in range(6)]
    assert_concurrent_round_trips(store, _host(seed=3), batches, 3)
