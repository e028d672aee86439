"""Keys from SGLang's placement never collide, unified keys serve another TP size, and an
object that is corrupt, truncated, forged, sealed under another secret, or of another dtype or
layout is a False (and so is every page after it in the batch), never wrong bytes."""
import os
from pathlib import Path

import pytest
import torch
from hicache_sglang import HiCacheAsyncStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from tests.plugins.sglang import harness as h

HASHES = [f"{i:064x}" for i in range(1, 5)]   # SGLang's keys are hex SHA-256 strings


def backend(pool, extra: dict, **placement) -> HiCacheAsyncStorage:
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                  is_mla_model=pool.layout != "page_head" and hasattr(pool, "kv_lora_rank"),
                  enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny/model")
    b = HiCacheAsyncStorage(HiCacheStorageConfig(**{**fields, **placement}, extra_config=extra))
    b.register_mem_pool_host(pool)
    return b


def seeded(pool, seed: int):
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def slots(n: int = 4) -> torch.Tensor:
    return torch.arange(n * h.PAGE)


def page(pool, i: int) -> torch.Tensor:
    return pool.get_data_page(i * h.PAGE).clone()


@pytest.mark.timeout(60)
def test_rank_suffix_keys_at_tp2_pp2_cp2_do_not_collide(tmp_path):
    extra = {"storage_path": str(tmp_path)}
    grid = [(t, p, c) for t in range(2) for p in range(2) for c in range(2)]
    ranks = {}
    for n, (t, p, c) in enumerate(grid):
        pool = seeded(h.host_pool("mha", "page_first", pages=4, heads=2), seed=n)
        b = backend(pool, extra, tp_rank=t, tp_size=2, pp_rank=p, pp_size=2, attn_cp_rank=c, attn_cp_size=2)
        assert b.batch_set_v1(HASHES, slots()) == [True] * 4
        ranks[(t, p, c)] = (b, pool, [page(pool, i) for i in range(4)])
    keys = {spec.key for b, _, _ in ranks.values() for spec in b.store.keys.objects(HASHES[0])}
    assert len(keys) == len(grid)
    for b, pool, want in ranks.values():
        pool.kv_buffer.zero_()
        assert b.batch_get_v1(HASHES, slots()) == [True] * 4
        assert all(torch.equal(page(pool, i), want[i]) for i in range(4))
        b.close()


@pytest.mark.timeout(60)
def test_mla_ranks_share_one_object_and_only_the_writer_writes(tmp_path):
    extra = {"storage_path": str(tmp_path)}
    writer = backend(seeded(h.host_pool("mla", "page_first"), 1), extra, tp_rank=0, tp_size=2, is_mla_model=True)
    other = backend(seeded(h.host_pool("mla", "page_first"), 2), extra, tp_rank=1, tp_size=2, is_mla_model=True)
    assert other.batch_set_v1(HASHES, slots()) == [True] * 4     # acknowledged, not written
    assert other.batch_exists(HASHES) == 0
    assert writer.batch_set_v1(HASHES, slots()) == [True] * 4
    assert other.batch_get_v1(HASHES, slots()) == [True] * 4
    assert all(torch.equal(page(other.mem_pool_host, i), page(writer.mem_pool_host, i)) for i in range(4))


@pytest.mark.timeout(60)
def test_unified_keys_a_tp2_writer_serves_tp4_readers(tmp_path):
    extra = {"storage_path": str(tmp_path), "key_scheme": "unified"}
    written = []
    for r in range(2):      # 4 kv heads, 2 a rank; tp_lcm_size 4 splits objects at the readers' grain
        pool = seeded(h.host_pool("mha", "page_first", pages=4, heads=2), seed=10 + r)
        w = backend(pool, extra, tp_rank=r, tp_size=2, tp_lcm_size=4)
        assert w.batch_set_v1(HASHES, slots()) == [True] * 4
        written.append([page(pool, i).view(2, h.PAGE, h.LAYERS, 2, h.DIM) for i in range(4)])
    for q in range(4):
        pool = h.host_pool("mha", "page_first", pages=4, heads=1)
        reader = backend(pool, {**extra, "kv_heads": 4}, tp_rank=q, tp_size=4)
        assert reader.batch_get_v1(HASHES, slots()) == [True] * 4
        for i in range(4):
            want = written[q // 2][i][:, :, :, q % 2:q % 2 + 1]
            assert torch.equal(page(pool, i).view(2, h.PAGE, h.LAYERS, 1, h.DIM), want)
    lone = backend(h.host_pool("mha", "page_first", pages=4, heads=1), extra, tp_rank=0, tp_size=4)
    assert lone.batch_get_v1(HASHES, slots()) == [False] * 4   # one head a rank, model's heads unknown: no guess


def _object(root: Path, page_hash: str) -> Path:
    return next(p for p in root.rglob("*") if p.is_file() and p.name.startswith(page_hash))


def _stored(tmp_path, attention="mha", layout="page_first", **extra):
    extra = {"storage_path": str(tmp_path / "l3"), **extra}
    writer = backend(seeded(h.host_pool(attention, layout, pages=4), 3), extra)
    assert writer.batch_set_v1(HASHES, slots()) == [True] * 4
    return extra


@pytest.mark.parametrize("attention,layout", [("mha", "page_first"), ("mla", "page_first_direct")])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_and_truncated_objects_end_the_run(tmp_path, attention, layout, damage):
    extra = _stored(tmp_path, attention, layout)
    victim = _object(tmp_path / "l3", HASHES[1])
    blob = bytearray(victim.read_bytes())
    if damage == "flip":
        blob[-3] ^= 0x40
    else:
        del blob[-16:]
    victim.write_bytes(bytes(blob))
    pool = h.host_pool(attention, layout, pages=4)
    reader = backend(pool, extra)
    assert reader.batch_get_v1(HASHES, slots()) == [True, False, False, False]
    assert reader.store.counters.corrupt_objects == 1


def test_forged_objects_and_another_secret_are_misses(tmp_path):
    secrets = []
    for name in ("a", "b"):
        path = tmp_path / name
        path.write_bytes(os.urandom(32))
        path.chmod(0o600)
        secrets.append(str(path))
    extra = _stored(tmp_path, storage_secret_file=secrets[0])
    own = backend(h.host_pool("mha", "page_first", pages=4), extra)
    assert own.batch_get_v1(HASHES, slots()) == [True] * 4
    other = backend(h.host_pool("mha", "page_first", pages=4), {**extra, "storage_secret_file": secrets[1]})
    assert other.batch_get_v1(HASHES, slots()) == [False] * 4
    plain = backend(h.host_pool("mha", "page_first", pages=4), {"storage_path": extra["storage_path"]})
    assert plain.batch_get_v1(HASHES, slots()) == [False] * 4
    victim = _object(tmp_path / "l3", HASHES[2])   # altered under the right secret: forged
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 1
    victim.write_bytes(bytes(blob))
    assert own.batch_get_v1(HASHES, slots()) == [True, True, False, False]
    assert own.store.counters.forged_objects == 1


@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, "page_first"), (torch.float16, "layer_first")])
def test_another_dtype_or_layout_misses(tmp_path, dtype, layout):
    extra = _stored(tmp_path)
    pool = h.host_pool("mha", layout, pages=4, dtype=dtype)
    assert backend(pool, extra).batch_get_v1(HASHES, slots()) == [False] * 4
    assert not pool.kv_buffer.any()


def test_a_failing_store_is_false_never_an_exception(tmp_path):
    b = backend(h.host_pool("mha", "page_first", pages=4), {"storage_path": str(tmp_path)})
    assert b.batch_get_v1(HASHES, torch.arange(3)) == [False] * 4      # wrong slot count
    assert b.batch_set_v1(HASHES, torch.arange(3)) == [False] * 4
    b.close()
    assert b.batch_get_v1(HASHES, slots()) == [False] * 4 and b.batch_exists(HASHES) == 0


def test_a_read_given_up_on_is_answered_only_once_it_can_no_longer_write(tmp_path):
    """SGLang reuses host pages as soon as a get answers: a late read must not outlive it."""
    from hicache_async.config import CacheConfig
    from hicache_async.topology import RankCoords
    from hicache_async.transfer.l3_session import guarded_store
    from tests.helpers.slow_backend import SlowZeroCopy

    pool = seeded(h.host_pool("mla", "page_first_direct", pages=4), 3)     # a page is one run: read in place
    b = backend(pool, {"storage_path": str(tmp_path)})
    slow = SlowZeroCopy(slow_read_s=1.0)
    b.store = guarded_store(slow, "slow", b.layout, RankCoords(), CacheConfig(storage_timeout_s=0.2))
    assert b.batch_set_v1(HASHES, slots()) == [True] * 4
    assert b.batch_get_v1(HASHES, slots()) == [False] * 4     # past its deadline: a miss...
    assert slow.late_reads == 1 and slow.late_parts           # ...answered after it wrote, in place


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_page_first_objects_hold_pages_in_memory_order_and_older_objects_miss(tmp_path, attention):
    """A page_first page is a K and a V run (MHA; one run MLA) in SGLang's buffer: its object
    holds those bytes as they lie there, under keys of their own; an object in our order, as
    stores built without the pool wrote it, is a miss, never read as this order."""
    from hicache_async.config import CacheConfig
    from hicache_async.topology import RankCoords
    from hicache_async.transfer.l3_session import guarded_store
    from hicache_async.transfer.objects import HEADER_BYTES

    extra, mla = {"storage_path": str(tmp_path / "l3")}, attention == "mla"
    pool = seeded(h.host_pool(attention, "page_first", pages=4), 5)
    writer = backend(pool, extra, is_mla_model=mla)
    assert writer.store.layout.page_order and writer.batch_set_v1(HASHES, slots()) == [True] * 4
    for i, page_hash in enumerate(HASHES):
        rows = pool.kv_buffer[i * h.PAGE:(i + 1) * h.PAGE] if mla else pool.kv_buffer[:, i * h.PAGE:(i + 1) * h.PAGE]
        assert _object(tmp_path / "l3", page_hash).read_bytes()[HEADER_BYTES:] == rows.numpy().tobytes()
    older = seeded(h.host_pool(attention, "page_first", pages=4), 6)
    old = backend(older, extra, is_mla_model=mla)
    old.store = guarded_store(writer.store.adapter, "file", old.layout, RankCoords(), CacheConfig())
    hashes = [f"{i:064x}" for i in range(11, 15)]
    assert old.batch_set_v1(hashes, slots()) == [True] * 4
    reader = backend(h.host_pool(attention, "page_first", pages=4), extra, is_mla_model=mla)
    assert reader.batch_get_v1(hashes, slots()) == [False] * 4 and not reader.mem_pool_host.kv_buffer.any()
    assert reader.store.counters.corrupt_objects == 0
    assert reader.batch_get_v1(HASHES, slots()) == [True] * 4
    assert torch.equal(reader.mem_pool_host.kv_buffer[:4 * h.PAGE] if mla else
                       reader.mem_pool_host.kv_buffer[:, :4 * h.PAGE],
                       pool.kv_buffer[:4 * h.PAGE] if mla else pool.kv_buffer[:, :4 * h.PAGE])
