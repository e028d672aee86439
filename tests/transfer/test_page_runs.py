"""Pages that lie in several runs of an engine's buffer (K and V apart, a run a layer) move in
place, as their runs in order, checksummed over them: the objects are the bytes a contiguous
pool stores, a flipped byte in any run is corrupt, and a read given up on is named late."""
import os
import threading

import pytest
import torch
import xxhash

from hicache_async.config import CacheConfig
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool, byte_runs
from hicache_async.storage.base import buffer_address
from hicache_async.storage.file import FileStorage
from hicache_async.storage.guarded import GuardedStorage
from hicache_async.transfer import checksums
from hicache_async.transfer.objects import HEADER_BYTES, checksum
from hicache_async.transfer.page_store import PageStore
from tests.helpers.slow_backend import SlowZeroCopy

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=32, page_size=16)   # 4 KiB a layer's K (or V)
PAGES = 6
RUN = LAYOUT.layer_page_bytes // 2
KEYS = make_key_scheme("rank-suffix", LAYOUT)
HASHES = page_hashes(range(PAGES * LAYOUT.page_size), LAYOUT.page_size)


@pytest.fixture(params=[0, 2], ids=["inline", "pooled"])
def workers(request, monkeypatch):
    monkeypatch.setattr(checksums, "CHECKSUM_WORKERS", request.param)
    return request.param


def _split(seed: int | None = None) -> tuple[HostPool, torch.Tensor]:
    """A pool over SGLang's page_first_direct buffer (planes, pages, layers, tokens, heads, dim):
    each page is four runs, K and V of each layer, and its buffer."""
    kv = torch.zeros((2, PAGES, LAYOUT.num_layers, LAYOUT.page_size, LAYOUT.kv_heads, LAYOUT.head_dim))
    if seed is not None:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    return HostPool(LAYOUT, PAGES, tensor=kv.permute(1, 2, 0, 3, 4, 5)), kv


def _stored(tmp_path) -> tuple[FileStorage, HostPool]:
    storage, (host, _) = FileStorage(str(tmp_path / "l3")), _split(seed=0)
    assert PageStore(storage, LAYOUT, KEYS).backup(HASHES, host, list(range(PAGES))).ok == [True] * PAGES
    return storage, host


def test_a_page_of_split_planes_is_its_runs_in_page_order():
    host, kv = _split()
    assert byte_runs(HostPool(LAYOUT, 2).tensor[0]) == [(0, LAYOUT.page_bytes)]
    base = kv.data_ptr()
    starts = [kv[plane, 0, layer].data_ptr() - base for layer in range(2) for plane in range(2)]
    assert host.runs == [(at, RUN) for at in starts]     # K0, V0, K1, V1: the view's own order


@pytest.mark.parametrize("sizes", [[RUN] * 4, [1, 239, 17, 4096, 3], [0, 100, 0]])
def test_the_digest_of_runs_is_the_digest_of_their_bytes_in_one(sizes):
    blob = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    whole = memoryview(blob.numpy()).cast("B")
    runs, at = [], 0
    for n in sizes:
        runs.append(whole[at:at + n])
        at += n
    assert checksum(runs) == checksum(whole) == xxhash.xxh3_64_intdigest(bytes(whole))


def test_split_pages_round_trip_in_place_as_the_objects_a_contiguous_pool_stores(tmp_path, workers):
    storage, host = _stored(tmp_path)
    flat = HostPool(LAYOUT, PAGES)
    flat.tensor.copy_(host.tensor)
    other = FileStorage(str(tmp_path / "flat"))
    assert PageStore(other, LAYOUT, KEYS).backup(HASHES, flat, list(range(PAGES))).ok == [True] * PAGES
    for key in (spec.key for h in HASHES for spec in KEYS.objects(h)):    # byte for byte the same objects
        with open(storage._path(key), "rb") as a, open(other._path(key), "rb") as b:
            assert a.read() == b.read()
    reader, kv = _split()
    store = PageStore(storage, LAYOUT, KEYS)
    got = store.prefetch(HASHES, reader, list(range(PAGES)))
    assert (got.pages, got.corrupt) == (PAGES, 0) and torch.equal(reader.tensor, host.tensor)
    assert store.staging.buffer_bytes < PAGES * LAYOUT.page_bytes   # only headers staged: payloads read in place
    flat.tensor.zero_()                                 # and a contiguous pool reads them too
    assert store.prefetch(HASHES, flat, list(range(PAGES))).pages == PAGES and torch.equal(flat.tensor, host.tensor)


@pytest.mark.parametrize("run", [0, 3], ids=["first-run", "last-run"])
def test_a_flipped_byte_in_any_run_is_corrupt_and_ends_the_read_at_its_page(tmp_path, workers, run):
    storage, host = _stored(tmp_path)
    path = storage._path(KEYS.objects(HASHES[2])[0].key)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + run * RUN + 123)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    reader, _ = _split()
    store = PageStore(storage, LAYOUT, KEYS)
    got = store.prefetch(HASHES, reader, list(range(PAGES)))
    assert (got.pages, got.corrupt, store.counters.corrupt_objects) == (2, 1, 1)
    assert torch.equal(reader.tensor[:2], host.tensor[:2])


def test_a_read_of_split_pages_given_up_on_is_named_late_and_lands_in_the_host_pages():
    slow = SlowZeroCopy(slow_read_s=0.5)
    host, _ = _split(seed=0)
    assert PageStore(slow, LAYOUT, KEYS).backup(HASHES, host, list(range(PAGES))).ok == [True] * PAGES
    reader, kv = _split()
    store = PageStore(GuardedStorage(slow, CacheConfig(storage_timeout_s=0.2)), LAYOUT, KEYS)
    got = store.prefetch(HASHES, reader, list(range(PAGES)))
    assert (got.pages, got.errors, len(got.late)) == (0, 1, 1)
    assert not got.late[0].returned() and torch.count_nonzero(kv) == 0
    returned = threading.Event()
    got.late[0].when_returned(returned.set)
    assert returned.wait(10)
    runs = [part for i, part in enumerate(slow.late_parts) if i % 5]       # a header, then 4 runs
    start, end = kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()
    assert len(runs) == 4 * PAGES and all(start <= buffer_address(run) < end for run in runs)
    assert torch.equal(reader.tensor, host.tensor)      # its bytes did land, late, in the host pages
