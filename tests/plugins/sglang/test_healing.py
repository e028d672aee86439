"""SGLang's face heals as the page store does: with every object of a prefix damaged, the read
is all False; SGLang's backup of the recomputed pages rewrites every one, and a new backend then
reads the whole prefix, byte for byte. Real file stores in temp dirs."""
import pytest
import torch

from tests.plugins.sglang import harness as h
from tests.plugins.sglang.test_keys_and_misses import HASHES, backend, page, seeded, slots


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attention,layout", [("mha", "page_first"), ("mla", "page_first_direct")])
def test_one_backup_heals_every_damaged_object_of_a_prefix(tmp_path, attention, layout):
    extra = {"storage_path": str(tmp_path / "l3")}
    pool = seeded(h.host_pool(attention, layout, pages=4), 3)
    assert backend(pool, extra).batch_set_v1(HASHES, slots()) == [True] * 4
    want = [page(pool, i) for i in range(4)]
    objects = [p for p in (tmp_path / "l3").rglob("*") if p.is_file()]
    assert len(objects) == 4
    for obj in objects:
        blob = bytearray(obj.read_bytes())
        blob[-3] ^= 0x40
        obj.write_bytes(bytes(blob))

    reader = backend(h.host_pool(attention, layout, pages=4), extra)
    assert reader.batch_get_v1(HASHES, slots()) == [False] * 4
    seeded(reader.mem_pool_host, 3)                      # the recompute: the same KV again
    assert reader.batch_set_v1(HASHES, slots()) == [True] * 4
    assert reader.store.counters.healed_objects == 4
    fresh = backend(h.host_pool(attention, layout, pages=4), extra)
    assert fresh.batch_get_v1(HASHES, slots()) == [True] * 4
    assert all(torch.equal(page(fresh.mem_pool_host, i), want[i]) for i in range(4))
