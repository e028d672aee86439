"""A sealed store on a real mooncake_master (see mooncake_fixture): sealed objects move through
the zero-copy calls from and into registered staging, and those of another secret are forgeries."""
import os

import torch

from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.hicache.plugin import HiCachePlugin
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.sealed import SealedStorage, load_key
from hicache_async.transfer.page_store import PageStore
from tests.helpers.engine_run import L3_WORKLOAD, assert_matches_reference

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=16)   # 64 KiB pages


def _key(path):
    path.write_bytes(os.urandom(48))
    path.chmod(0o600)
    return load_key(str(path))


def test_sealed_pages_round_trip_and_another_secret_reads_forgeries(mooncake_storage, tmp_path):
    keys = make_key_scheme("unified", LAYOUT, head_group=1)
    hashes = page_hashes(range(31_000, 31_000 + 8 * 16), 16)
    host = HostPool(LAYOUT, 8)
    host.tensor.normal_(generator=torch.Generator().manual_seed(3))
    sealed = PageStore(SealedStorage(mooncake_storage, _key(tmp_path / "a")), LAYOUT, keys)
    assert sealed.backup(hashes, host, list(range(8))).ok == [True] * 8
    reader = HostPool(LAYOUT, 8)
    got = sealed.prefetch(hashes, reader, list(range(8)))
    assert (got.pages, got.forged) == (8, 0) and torch.equal(reader.tensor, host.tensor)
    other = PageStore(SealedStorage(mooncake_storage, _key(tmp_path / "b")), LAYOUT, keys)
    got = other.prefetch(hashes, HostPool(LAYOUT, 8), list(range(8)))
    assert (got.pages, got.forged, other.counters.forged_objects) == (0, 1, 1)
    got = PageStore(mooncake_storage, LAYOUT, keys).prefetch(hashes, HostPool(LAYOUT, 8), list(range(8)))
    assert (got.pages, got.corrupt) == (0, 1)             # without the secret: not even the size fits


def test_a_run_on_a_sealed_mooncake_store_matches_the_reference(mooncake_master, tmp_path):
    from hicache_mooncake import MooncakeStorage

    cfg = CacheConfig(device_pages=24, host_pages=40, page_size=8, prefetch_threshold=8)
    storage = SealedStorage(MooncakeStorage(mooncake_master.address, mooncake_master.metadata_url,
                                            buffer_bytes=16 << 20), _key(tmp_path / "secret"))
    try:
        report = assert_matches_reference(HiCachePlugin(cfg, storage=storage, storage_name="mooncake"),
                                          L3_WORKLOAD, ModelConfig())
    finally:
        storage.close()
    assert report["tokens_from_l3"] > 0 and report["forged_objects"] == 0 and report["storage_errors"] == 0, report
