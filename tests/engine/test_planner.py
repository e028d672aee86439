"""The planner's pure parts: the hardware model's split of a page over ranks and its transfer
times, bad planner flags, TTFT on the virtual clock with no cache and the ideal cache, the
per-request oracle against the total one, and how a miss is named."""
import dataclasses
from pathlib import Path

import pytest

from hicache_async.app.cli import main
from hicache_async.engine.replay.hardware import PRESETS, HardwareModel
from hicache_async.engine.replay.timing import timed_run
from hicache_async.engine.replay.trace import TraceRequest, read_trace
from hicache_async.engine.replay.workload import ReplaySpec
from hicache_async.errors import UsageError
from hicache_async.hicache.page_history import L3Look, Miss, PageHistory
from hicache_async.sim.jobs.oracle import unbounded_oracle
from hicache_async.sim.jobs.reusable import reusable_tokens
from hicache_async.topology import RankCoords

TRACE = str(Path(__file__).parents[1] / "data" / "short_trace.jsonl")


def _grid(tp: int, pp: int, cp: int):
    return [RankCoords.of(r, tp, pp, cp) for r in range(tp * pp * cp)]


def test_presets_carry_the_kv_bytes_of_their_configs():
    assert {name: p.kv_bytes_per_token for name, p in PRESETS.items()} == {
        "llama-3.1-8b": 131_072, "llama-3.1-70b": 327_680, "qwen3-30b-a3b": 98_304, "deepseek-v3": 70_272}
    assert HardwareModel(kv_bytes_per_token=1000).token_bytes == 1000
    assert HardwareModel(model="llama-3.1-70b").costs.prefill_us_per_token == 45.0
    assert HardwareModel(prefill_us_per_token=3.0).costs.prefill_us_per_token == 3.0


@pytest.mark.parametrize("tp,pp,share", [(1, 1, 1.0), (2, 1, 0.5), (8, 1, 1 / 8), (16, 1, 1 / 8), (2, 4, 1 / 8)])
def test_tp_splits_heads_and_pp_layers(tp, pp, share):
    hw = HardwareModel()      # 8 kv heads, 32 layers
    assert all(hw.rank_share(c) == pytest.approx(share) for c in _grid(tp, pp, 1))


def test_uneven_layers_split_as_the_stages_hold_them_and_mla_is_never_split_by_tp():
    hw = HardwareModel(model="deepseek-v3")     # 61 layers, one latent
    shares = [hw.rank_share(c) for c in _grid(4, 2, 1)]
    assert shares == [31 / 61] * 4 + [30 / 61] * 4


@pytest.mark.parametrize("model,tp,pp,cp", [("llama-3.1-8b", 2, 2, 3), ("llama-3.1-70b", 8, 1, 2),
                                            ("qwen3-30b-a3b", 4, 3, 1), ("deepseek-v3", 4, 2, 2)])
def test_the_ranks_together_store_each_page_once(model, tp, pp, cp):
    """CP ranks split a transfer's pages; an MLA latent is written by one TP rank, read by all."""
    hw, pages = HardwareModel(model=model), 37
    grid = _grid(tp, pp, cp)
    stored = sum(hw.rank_pages("backup", pages, c) * hw.rank_share(c) for c in grid)
    assert stored == pytest.approx(pages)
    read = sum(hw.rank_pages("prefetch", pages, c) * hw.rank_share(c) for c in grid)
    assert read == pytest.approx(pages * (tp if PRESETS[model].mla else 1))
    assert sorted({hw.rank_pages("load", pages, c) for c in grid}) == sorted({pages // cp, -(-pages // cp)})


def test_transfer_times_follow_their_link_and_pay_latency_per_storage_call():
    hw = HardwareModel(pcie_gbps=50, l3_read_gbps=7, l3_write_gbps=5, l3_latency_us=100)
    page = 64 * 131_072
    assert hw.transfer_s("write", 10, RankCoords(), 64) == pytest.approx((10 * page / 50e9, 0.0))
    assert hw.transfer_s("load", 10, RankCoords(), 64) == pytest.approx((10 * page / 50e9, 0.0))
    assert hw.transfer_s("prefetch", 64, RankCoords(), 64) == pytest.approx((64 * page / 7e9, 100e-6))
    assert hw.transfer_s("backup", 65, RankCoords(), 64) == pytest.approx((65 * page / 5e9, 200e-6))
    tp2 = RankCoords(tp_rank=1, tp_size=2)
    assert hw.transfer_s("backup", 65, tp2, 64)[0] == pytest.approx(65 * page / 2 / 5e9)
    mla = HardwareModel(model="deepseek-v3")
    assert mla.transfer_s("backup", 65, tp2, 64) == (0.0, 0.0)     # TP rank 0 stores the latent


@pytest.mark.parametrize("argv,named", [
    (["--model", "gpt-5"], "unknown --model 'gpt-5': the presets are llama-3.1-8b, llama-3.1-70b, "
                           "qwen3-30b-a3b, deepseek-v3"),
    (["--pcie-gbps", "0"], "--pcie-gbps must be positive, got 0.0"),
    (["--l3-read-gbps", "-2"], "--l3-read-gbps must be positive, got -2.0"),
    (["--l3-write-gbps", "nan"], "--l3-write-gbps must be positive, got nan"),
    (["--l3-latency-us", "0"], "--l3-latency-us must be positive, got 0.0"),
    (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token must be positive, got 0"),
    (["--kv-bytes-per-token", "lots"], "--kv-bytes-per-token: expected a number, got 'lots'"),
])
def test_bad_planner_flags_are_one_line_usage_errors(argv, named, capsys):
    assert main(["replay", TRACE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-async: error:") and named in err, err


def test_a_sweep_that_sets_a_bad_hardware_value_fails_alike():
    with pytest.raises(UsageError, match="--l3-read-gbps must be positive, got 0"):
        dataclasses.replace(HardwareModel(), l3_read_gbps=0)


def _req(line, ts, n, ids, out=1):
    return TraceRequest(line, ts, n, out, tuple(ids))


def test_ttft_runs_from_arrival_to_the_forward_that_computes_the_last_prompt_token():
    """One decode step (10 ms) plus 20 us a computed prompt token: requests arriving together
    share a forward pass; a later one waits for the forward in flight; free tokens cost nothing."""
    trace = [_req(1, 0.0, 1000, [1, 2]), _req(2, 0.0, 500, [3]), _req(3, 5.0, 100, [4])]
    spec = ReplaySpec(trace="-", hardware=HardwareModel())
    none = timed_run(trace, spec, 64, device_pages=64)
    # t=0: lines 1+2 in one pass, 10 + 1500 x 0.02 = 40 ms; line 3 arrived at 5 ms, runs next: 40 + 12 = 52
    assert list(none.ttft_us) == pytest.approx([40_000, 40_000, 47_000])
    ideal = timed_run(trace, spec, 64, device_pages=64, free={1: 640, 3: 64})
    assert list(ideal.ttft_us) == pytest.approx([10_000 + 860 * 20] * 2 + [27_200 + 10_000 + 36 * 20 - 5_000])
    assert ideal.last_us == pytest.approx(27_200 + 10_720)


@dataclasses.dataclass(frozen=True)
class _Salted:
    line: int
    input_length: int
    hash_ids: tuple
    cache_salt: str | None = None


def test_the_per_request_oracle_adds_up_to_the_total_and_keeps_tenants_apart():
    trace = read_trace(TRACE, 64)
    per_request = reusable_tokens(trace, 64)
    assert sum(per_request.values()) == unbounded_oracle(trace, 64).tokens > 0
    assert set(per_request) == {r.line for r in trace}
    salted = [_Salted(i, 1100, (7, 8, 9), salt) for i, salt in enumerate(["a", "b", "a", None, None], 1)]
    assert reusable_tokens(salted, 64) == {1: 0, 2: 0, 3: 1088, 4: 0, 5: 1088}
    assert reusable_tokens(salted, 512) == {1: 0, 2: 0, 3: 1024, 4: 0, 5: 1024}


def test_a_miss_is_named_by_what_became_of_its_page():
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    history = PageHistory()
    history.inserted([a, b])
    history.backed_up([a])                            # no backup of b retired
    assert history.why_absent(c, l3=True) is Miss.STILL_COMPUTING
    assert history.why_absent(a, l3=False) is Miss.EVICTED
    assert history.why_absent(a, l3=True) is Miss.EVICTED_WHILE_WAITING
    assert history.why_absent(b, l3=True) is Miss.DROPPED_BEFORE_BACKUP
    never = lambda hashes: 0       # noqa: E731 - an empty store
    assert history.stored_run([c, a, a, b, a], 1, never) == 2
    d = "d" * 64                   # never cached in this run: only the store can say
    assert history.stored_run([a, c, d, b], 0, lambda hashes: len(hashes)) == 3
    assert history.stored_run([a, c, d, a], 0, lambda hashes: 1) == 2
    assert history.stored_run([c, a], 0, never) == 0
    look = L3Look(first=2, end=6, beyond=Miss.STILL_COMPUTING, outcome=None)     # fetched pages 2..5
    assert look.why_missed(1, committed=4) is None                               # before the look: not its call
    assert look.why_missed(6, committed=4) is Miss.STILL_COMPUTING
    assert look.why_missed(3, committed=2) is Miss.EVICTED_AFTER_FETCH
    assert look.why_missed(4, committed=2) is Miss.CUT_SHORT
    assert L3Look(2, 6, None, Miss.DECLINED).why_missed(5, committed=0) is Miss.DECLINED
