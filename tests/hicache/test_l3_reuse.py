"""L3 pays off on the defaults: a second `simulate` over the same storage reads back what the
first wrote (file storage, and a long-lived Mooncake master), and computes fewer tokens."""
import json
import os
import subprocess
import sys

import pytest

from hicache_async.hicache.prefetch_cost import PrefetchCost
from hicache_async.layout import KVLayout
from hicache_async.parallel.agreement import NOT_READY
from hicache_async.topology import RankCoords

CLI = [sys.executable, "-m", "hicache_async", "simulate"]


def _twice(tmp_path, *flags: str) -> tuple[dict, dict]:
    out = []
    for run in (1, 2):
        path = tmp_path / f"run{run}.json"
        done = subprocess.run([*CLI, *flags, "--json", str(path)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
        assert done.returncode == 0, done.stderr[-2000:]
        out.append(json.loads(path.read_text()))
    return out[0], out[1]


def _check_reuse(first: dict, second: dict) -> None:
    assert first["l3_bytes_written"] > 0 and second["l3_bytes_read"] > 0, (first, second)
    assert second["tokens_from_l3"] > 0, second
    assert second["tokens_computed"] < first["tokens_computed"], (first, second)
    for run in (first, second):
        assert run["kv_mismatches"] == 0 and run["outputs_match_reference"] and run["corrupt_objects"] == 0


def test_a_second_run_on_the_default_file_storage_reads_l3(tmp_path):
    _check_reuse(*_twice(tmp_path))            # the defaults: file storage in XDG_CACHE_HOME


def test_a_second_run_on_a_long_lived_mooncake_master_reads_l3(tmp_path, mooncake_master):
    _check_reuse(*_twice(tmp_path, "--storage", "mooncake", "--mooncake-master", mooncake_master.address,
                         "--mooncake-metadata", mooncake_master.metadata_url))


PAGE_16KIB = KVLayout(num_layers=4, kv_heads=2, head_dim=16, page_size=16)   # the fetch times below assume it


def test_prefetch_is_issued_when_fetching_beats_recomputing():
    cost = PrefetchCost(PAGE_16KIB, RankCoords(), prefill_us_per_token=50, l3_gbps=1.0, l3_latency_us=1000)
    assert not cost.decide(pages=1, tokens=16).fetch     # 1.02 ms to fetch, 0.8 ms to recompute
    assert cost.decide(pages=2, tokens=32).fetch         # 1.03 ms against 1.6 ms
    slow = PrefetchCost(PAGE_16KIB, RankCoords(), prefill_us_per_token=50, l3_gbps=0.001, l3_latency_us=1000)
    assert not slow.decide(pages=64, tokens=1024).fetch  # 1 GB/s L3 no more: recompute


def test_the_bandwidth_estimate_moves_only_by_agreed_samples():
    cost = PrefetchCost(PAGE_16KIB, RankCoords(tp_size=2, tp_rank=1), prefill_us_per_token=50, l3_gbps=1.0,
                        l3_latency_us=0)
    assert cost.page_bytes == PAGE_16KIB.page_bytes / 2  # this rank's share, the same on every rank
    replica = PrefetchCost(PAGE_16KIB, RankCoords(tp_size=4, tp_rank=3), prefill_us_per_token=50, l3_gbps=1.0,
                           l3_latency_us=0)
    assert replica.page_bytes == PAGE_16KIB.page_bytes / 2  # tp4 on 2 heads: each rank holds one whole head
    cost.observe(nbytes=10_000_000, seconds=1.0)          # 10 MB/s seen by this rank
    cost.observe(nbytes=40_000_000, seconds=1.0)
    assert cost.offer() == 10_000 and cost.offer() == NOT_READY   # the slowest, offered once
    before = cost.decide(64, 1024).fetch_s
    cost.agreed(NOT_READY)                                # no rank had a sample: nothing moves
    assert cost.decide(64, 1024).fetch_s == before
    cost.agreed(10_000)                                   # the MIN every rank received
    assert cost.bytes_per_s == pytest.approx(0.5 * 1e9 + 0.5 * 1e7)
