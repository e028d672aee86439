"""A whole page of a buffer whose memory order takes fewer runs than ours (SGLang's page_first: a K
and a V run, against a run a token and layer) is stored in memory order under rank-suffix keys:
it moves in place, byte exact and verified, a flipped byte is still corrupt, and its namespace is
its own, so objects in our order (today's) miss instead of being misread. Pools already in our
order keep their keys and bytes, and unified keys never change. Objects that are strided views
(a head group) are gathered into staging the store reuses, and a backup counts the pages it wrote."""
import os

import pytest
import torch

from hicache_async.config import CacheConfig
from hicache_async.errors import UsageError
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage import staging
from hicache_async.storage.file import FileStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer import checksums, page_store
from hicache_async.transfer.l3_session import guarded_store
from hicache_async.transfer.objects import HEADER_BYTES
from hicache_async.transfer.page_store import PageStore

PAGES, LAYERS, HEADS, DIM, PS = 6, 4, 2, 32, 16
MHA = KVLayout(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, page_size=PS, dtype=torch.float16)
MLA = KVLayout(num_layers=LAYERS, kv_heads=1, head_dim=DIM, page_size=PS, dtype=torch.float16, attention="mla",
               axes=("token", "head", "dim"))
HASHES = page_hashes(range(PAGES * PS), PS)


@pytest.fixture(params=[0, 2], ids=["inline", "pooled"])
def workers(request, monkeypatch):
    monkeypatch.setattr(checksums, "CHECKSUM_WORKERS", request.param)
    return request.param


def page_first(layout: KVLayout, seed: int | None = None) -> tuple[HostPool, torch.Tensor]:
    """A pool over SGLang's page_first buffer, as its host view builds it: MHA (2, tokens, layers,
    heads, dim), MLA (tokens, layers, 1, dim); and the buffer."""
    if layout.attention == "mla":
        kv = torch.zeros((PAGES * PS, LAYERS, 1, DIM), dtype=layout.dtype)
        view = kv.view(PAGES, PS, LAYERS, 1, DIM).permute(0, 2, 1, 3, 4)
    else:
        kv = torch.zeros((2, PAGES * PS, LAYERS, HEADS, DIM), dtype=layout.dtype)
        view = kv.view(2, PAGES, PS, LAYERS, HEADS, DIM).permute(1, 3, 0, 2, 4, 5)
    if seed is not None:
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(seed)))
    return HostPool(layout, PAGES, tensor=view), kv


def memory_bytes(layout: KVLayout, kv: torch.Tensor, page: int) -> bytes:
    """A page's bytes in the buffer's own order: K then V, each (tokens, layers, heads, dim)."""
    rows = slice(page * PS, (page + 1) * PS)
    return (kv[rows] if layout.attention == "mla" else torch.cat([kv[0, rows], kv[1, rows]])).numpy().tobytes()


def store(l3: FileStorage, layout: KVLayout, host: HostPool | None = None, **config) -> PageStore:
    return guarded_store(l3, "file", layout, RankCoords(), CacheConfig(**config), host=host)


def keys(s: PageStore) -> list[str]:
    return [spec.key for h in HASHES for spec in s.keys.objects(h)]


@pytest.mark.parametrize("layout,staged", [(MHA, False), (MHA, True), (MLA, False)],
                         ids=["mha-in-place", "mha-staged", "mla-one-run"])
def test_a_page_first_page_is_stored_and_read_in_memory_order(tmp_path, workers, layout, staged, monkeypatch):
    """In place where its runs are big enough (one run always is), else through staging: in memory
    order either way."""
    monkeypatch.setattr(staging, "MIN_BUFFER", 4096)      # so a buffer of headers alone is smaller than the pages
    if staged:
        monkeypatch.setattr(page_store, "MIN_RUN_BYTES", layout.page_bytes)
    l3 = FileStorage(str(tmp_path / "l3"))
    host, kv = page_first(layout, seed=1)
    assert host.page_order and len(host.memory_runs) == layout.planes and len(host.runs) >= LAYERS * PS
    writer = store(l3, layout, host)
    got = writer.backup(HASHES, host, list(range(PAGES)))
    assert got.ok == [True] * PAGES and got.pages == PAGES
    assert (writer.staging.buffer_bytes >= PAGES * layout.page_bytes) == staged    # gathered only when staged
    for i, h in enumerate(HASHES):
        with open(l3._path(writer.keys.objects(h)[0].key), "rb") as f:
            assert f.read()[HEADER_BYTES:] == memory_bytes(layout, kv, i)
    reader_host, reader_kv = page_first(layout)
    reader = store(l3, layout, reader_host)
    assert reader.stored_run(HASHES) == PAGES
    got = reader.prefetch(HASHES, reader_host, list(range(PAGES)))
    assert (got.pages, got.corrupt) == (PAGES, 0) and torch.equal(reader_kv, kv)
    assert (reader.staging.buffer_bytes >= PAGES * layout.page_bytes) == staged     # else only headers staged


@pytest.mark.parametrize("run", [0, 1], ids=["k-run", "v-run"])
def test_a_flipped_byte_in_a_memory_order_object_is_corrupt(tmp_path, workers, run):
    l3 = FileStorage(str(tmp_path / "l3"))
    host, kv = page_first(MHA, seed=2)
    assert store(l3, MHA, host).backup(HASHES, host, list(range(PAGES))).ok == [True] * PAGES
    reader_host, reader_kv = page_first(MHA)
    reader = store(l3, MHA, reader_host)
    with open(l3._path(reader.keys.objects(HASHES[3])[0].key), "r+b") as f:
        f.seek(HEADER_BYTES + run * MHA.page_bytes // 2 + 777)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x08]))
    got = reader.prefetch(HASHES, reader_host, list(range(PAGES)))
    assert (got.pages, got.corrupt) == (3, 1)
    assert torch.equal(reader_host.tensor[:3], host.tensor[:3])


def test_an_object_in_our_order_is_a_miss_for_a_memory_order_store_never_a_misread(tmp_path):
    l3 = FileStorage(str(tmp_path / "l3"))
    host, kv = page_first(MHA, seed=3)
    today = store(l3, MHA)                       # the store as built before: our order, staged
    assert today.backup(HASHES, host, list(range(PAGES))).ok == [True] * PAGES
    reader_host, reader_kv = page_first(MHA)
    reader = store(l3, MHA, reader_host)
    assert set(keys(reader)).isdisjoint(keys(today))
    assert reader.stored_run(HASHES) == 0
    got = reader.prefetch(HASHES, reader_host, list(range(PAGES)))
    assert (got.pages, got.corrupt, got.errors) == (0, 0, 0) and not reader_kv.any()
    own = today.prefetch(HASHES, reader_host, list(range(PAGES)))     # today's store still reads its own
    assert own.pages == PAGES and torch.equal(reader_kv, kv)


def test_pools_of_other_memory_orders_get_other_keys_and_ours_keeps_its_own(tmp_path):
    l3 = FileStorage(str(tmp_path / "l3"))
    ours = HostPool(MHA, PAGES)                                     # our layout: one run a page
    layer_first = torch.zeros((2, LAYERS, PAGES * PS, HEADS, DIM), dtype=torch.float16)
    by_layer = HostPool(MHA, PAGES, tensor=layer_first.view(2, LAYERS, PAGES, PS, HEADS, DIM)
                        .permute(2, 1, 0, 3, 4, 5))                  # a K and a V run a layer either way
    direct = torch.zeros((2, PAGES, LAYERS, PS, HEADS, DIM), dtype=torch.float16)
    by_plane = HostPool(MHA, PAGES, tensor=direct.permute(1, 2, 0, 3, 4, 5))    # K run, V run
    first, _ = page_first(MHA)
    plain = keys(store(l3, MHA))
    assert ours.page_order == by_layer.page_order == "" and len(by_layer.memory_runs) == 2 * LAYERS
    assert keys(store(l3, MHA, ours)) == keys(store(l3, MHA, by_layer)) == plain
    assert by_plane.page_order and first.page_order and by_plane.page_order != first.page_order
    assert len({tuple(plain), tuple(keys(store(l3, MHA, by_plane))), tuple(keys(store(l3, MHA, first)))}) == 3
    with pytest.raises(UsageError, match="byte order"):            # a store built for one pool, given another
        store(l3, MHA, first).backup(HASHES, by_plane, list(range(PAGES)))


def test_unified_keys_and_objects_do_not_depend_on_memory_order(tmp_path, workers):
    l3 = FileStorage(str(tmp_path / "l3"))
    host, kv = page_first(MHA, seed=4)
    writer = store(l3, MHA, host, key_scheme="unified")
    assert keys(writer) == [s.key for h in HASHES for s in make_key_scheme("unified", MHA).objects(h)]
    assert writer.backup(HASHES, host, list(range(PAGES))).ok == [True] * PAGES
    flat = HostPool(MHA, PAGES)                  # a pool in our order reads the very same objects
    got = store(l3, MHA, flat, key_scheme="unified").prefetch(HASHES, flat, list(range(PAGES)))
    assert got.pages == PAGES and torch.equal(flat.tensor, host.tensor)


def test_a_staged_write_gathers_into_reused_staging_and_counts_written_pages(tmp_path, workers):
    l3 = FileStorage(str(tmp_path / "l3"))
    host, kv = page_first(MHA, seed=5)
    writer = store(l3, MHA, host, key_scheme="unified")    # an object a layer and head: strided views
    assert writer.backup(HASHES[:3], host, [0, 1, 2]).pages == 3
    staged = writer.staging.buffer_bytes
    assert staged >= 3 * MHA.page_bytes
    assert writer.backup(HASHES[3:], host, [3, 4, 5]).pages == 3 and writer.staging.buffer_bytes == staged
    again = writer.backup(HASHES, host, list(range(PAGES)))
    assert (again.pages, again.skipped, again.bytes) == (0, PAGES, 0)
    reader_host, reader_kv = page_first(MHA)
    got = store(l3, MHA, reader_host, key_scheme="unified").prefetch(HASHES, reader_host, list(range(PAGES)))
    assert (got.pages, got.corrupt) == (PAGES, 0) and torch.equal(reader_kv, kv)
