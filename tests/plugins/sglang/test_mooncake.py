"""Our backend over a real mooncake_master: pages round-trip, and a master that dies mid-run
costs each call its deadline at most (then the breaker answers at once), never the run."""
import time

import pytest
import torch

from tests.plugins.sglang import harness as h
from tests.plugins.sglang.test_keys_and_misses import HASHES, backend, page, seeded, slots

pytest.importorskip("mooncake", reason="the mooncake extra is not installed")


@pytest.mark.timeout(120)
def test_a_dead_master_costs_seconds_not_the_run(tmp_path):
    from hicache_mooncake import MooncakeMaster

    with MooncakeMaster(holder_bytes=64 << 20, log_path=str(tmp_path / "master.log")) as master:
        extra = {"storage": "mooncake", "mooncake_master": master.address, "mooncake_metadata": master.metadata_url,
                 "storage_timeout": 1.0}
        pool = seeded(h.host_pool("mha", "page_first", pages=4), 4)
        b = backend(pool, extra)
        want = [page(pool, i) for i in range(4)]
        assert b.batch_set_v1(HASHES, slots()) == [True] * 4
        pool.kv_buffer.zero_()
        assert b.batch_get_v1(HASHES, slots()) == [True] * 4
        assert all(torch.equal(page(pool, i), want[i]) for i in range(4))
        master.stop()
        start = time.monotonic()
        for _ in range(5):
            assert b.batch_set_v1([f"{9:064x}"], torch.arange(h.PAGE)) == [False]
            assert b.batch_get_v1(HASHES, slots()) == [False] * 4
        assert time.monotonic() - start < 15
        assert b.store.counters.storage_errors > 0
        b.close()
