"""TP above the number of kv heads: each kv head is replicated over tp/kv_heads ranks.

Replicas must compute the reference's KV, name it like the TP that splits the heads (same
keys, same bytes), and store it once: the first replica writes, the others only ack.
"""
import pytest
import torch

from hicache_async.app.cli import main
from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig, TinyModel
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.pools import HostPool
from hicache_async.sim.jobs.simulate_rank import payload_of
from hicache_async.sim.ranks.launcher import launch
from hicache_async.storage.memory import MemoryStorage
from hicache_async.topology import RankCoords
from hicache_async.transfer.page_store import PageStore
from tests.helpers.reference_kv import assert_like_reference, reference

SCHEMES = ("rank-suffix", "unified")
PAGE, PAGES = 8, 3
HASHES = page_hashes(range(PAGE * PAGES), PAGE)
MODEL = ModelConfig()   # 4 query heads, 2 kv heads
# World 4 on two cores is slow: a tiny workload, with pools small enough that L3 is read back.
SPEC = WorkloadSpec(requests=24, turns=4, system_prompts=2, system_len=32, user_len=(8, 16),
                    max_new=4, concurrency=6)
CACHE = dict(device_pages=24, host_pages=40, page_size=8, prefetch_threshold=8, sync_timeout_s=60)


def _layouts(tp: int) -> list:
    return [TinyModel(MODEL, RankCoords(tp_rank=r, tp_size=tp)).kv_layout(PAGE) for r in range(tp)]


def _store(storage, layout, scheme: str, tp: int, rank: int) -> PageStore:
    coords = RankCoords(tp_rank=rank, tp_size=tp)
    return PageStore(storage, layout, make_key_scheme(scheme, layout, coords), coords)


def test_replicas_hold_one_head_each_and_share_its_queries():
    model = TinyModel(MODEL, RankCoords(tp_rank=3, tp_size=4))
    assert model.kv_heads == range(1, 2) and model.weights[0].wq.shape[1] == MODEL.head_dim
    assert [(l.first_head, l.kv_heads) for l in _layouts(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_replica_per_head_writes_the_objects_tp2_writes(scheme):
    truth = torch.randn(PAGES, MODEL.layers, 2, PAGE, MODEL.kv_heads, MODEL.head_dim)
    stored = {}
    for tp in (2, 4):
        storage, written = MemoryStorage(), [0] * tp
        for rank, layout in reversed(list(enumerate(_layouts(tp)))):   # a writer's objects would hide
            host = HostPool(layout, PAGES)                                # a later replica's writes
            host.tensor[:] = truth[..., layout.first_head:layout.last_head + 1, :]
            store = _store(storage, layout, scheme, tp, rank)
            written[rank] = store.backup(HASHES, host, list(range(PAGES))).bytes
        assert [b > 0 for b in written] == {2: [True, True], 4: [True, False, True, False]}[tp]
        stored[tp] = storage._objects
    assert stored[4] == stored[2]           # same keys, byte for byte

    reader = MemoryStorage()                 # replicas read what tp2 wrote, same bytes
    reader._objects.update(stored[2])
    layouts = _layouts(4)
    stores = [_store(reader, layout, scheme, 4, rank) for rank, layout in enumerate(layouts)]
    for rank, (layout, store) in enumerate(zip(layouts, stores)):
        assert store.keys.objects(HASHES[0]) == stores[rank ^ 1].keys.objects(HASHES[0])  # replicas
        host = HostPool(layout, PAGES)
        got = store.prefetch(HASHES, host, list(range(PAGES)))
        assert (got.pages, got.corrupt) == (PAGES, 0)
        assert torch.equal(host.tensor, truth[..., layout.first_head:layout.last_head + 1, :])


@pytest.mark.parametrize("argv,named", [(["--tp", "3"], "--tp 3 neither divides the model's 2 kv heads"),
                                        (["--tp", "8"], "--tp 8 does not divide the model's 4 query heads")])
def test_cli_refuses_a_tp_that_cannot_replicate_heads(argv, named, capsys):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err


@pytest.mark.timeout(180)
def test_tp4_on_two_kv_heads_matches_reference_through_l3(tmp_path):
    outputs, kv_reference = reference(MODEL, SPEC, CACHE["page_size"])
    runs = {}
    for scheme in SCHEMES:
        runs[scheme] = payload_of(MODEL, CacheConfig(key_scheme=scheme, **CACHE), SPEC,
                                  {"name": "file", "options": {"path": str(tmp_path / scheme)}})
        runs[scheme]["kv_reference"] = kv_reference
    results = launch(tp=4, pp=1, cp=1, target="tests.helpers.sim_targets:matrix", payload={"runs": runs},
                     timeout_s=60)
    for name in runs:
        reports = [r[name] for r in results]
        first = assert_like_reference(reports, outputs, name)
        assert first["tokens_from_l3"] > 0, (name, first)
        assert sum(r["storage_errors"] + r["corrupt_objects"] for r in reports) == 0, name
        written = [r["l3_bytes_written"] for r in reports]
        assert written[1] == written[3] == 0 and written[0] == written[2] > 0, (name, written)
