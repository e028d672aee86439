"""`hicache-async replay TRACE`: a Mooncake-format trace served through the real plugin on the
replay engine across simulated ranks, every reused page verified, in the modelled time of a
served model on a machine (`engine/replay/hardware.py`). Beside it, from the trace alone: the unbounded-
cache oracle, the TTFT the trace gets with no cache and with that ideal cache, and where the
reuse the cache missed went."""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys

from ...config import CacheConfig
from ...engine.replay.model import ReplayModelSpec
from ...engine.replay.timing import timed_run
from ...engine.replay.trace import read_trace
from ...engine.replay.workload import ReplaySpec
from ...errors import UsageError
from ...request import pages_needed
from ...topology import check_topology
from ..ranks import torchrun
from .harness import TOKEN_FIELDS, RunArgs, launch_ranks, p50_p99, rank_figures, storage_spec
from .loss_account import EARLIER, check_account, lost_tokens
from .oracle import unbounded_oracle
from .reusable import reusable_tokens

TIER_NAMES = tuple(zip(TOKEN_FIELDS, ("L1 device", "L2 host", "L3 storage", "computed")))
CACHES = (("", "this cache"), ("baseline_", "no cache"), ("oracle_", "ideal cache"))
QUANTILES = (50, 90, 99)


def run(args: RunArgs, cache: CacheConfig, spec: ReplaySpec, model: ReplayModelSpec = ReplayModelSpec()) -> dict:
    trace = read_trace(spec.trace, cache.page_size, spec.limit)
    check_topology(args.tp, args.pp, args.cp, num_layers=model.layers, kv_heads=model.kv_heads, attention="mha")
    torchrun.check_world(args.tp, args.pp, args.cp)
    biggest = max(trace, key=lambda r: r.input_length + spec.max_new(r))
    need = pages_needed(biggest.input_length, spec.max_new(biggest), cache.page_size)
    if need > cache.device_pages:
        raise UsageError(f"--device-pages {cache.device_pages} cannot hold the request at {spec.trace}:"
                         f"{biggest.line} ({biggest.input_length} prompt + {spec.max_new(biggest)} output "
                         f"tokens need {need} pages of {cache.page_size})")
    # The cost rule weighs the modelled prefill; a storage call is an error only past the run's
    # own timeout, so a slow or busy machine never turns into a miss.
    cache = dataclasses.replace(cache, prefill_us_per_token=spec.costs.prefill_us_per_token,
                                storage_timeout_s=max(cache.storage_timeout_s, args.timeout_s))
    oracle = unbounded_oracle(trace, cache.page_size, spec.seed)
    reusable = reusable_tokens(trace, cache.page_size)
    with storage_spec(args, cold=True) as storage:   # a trace is measured from an empty L3
        payload = {"cache": dataclasses.asdict(cache), "replay": spec.to_dict(),
                   "model": dataclasses.asdict(model), "storage": storage}
        reports, run_id, seconds = launch_ranks(args, "hicache_async.sim.jobs.replay_rank:run_rank", payload,
                                                len(trace), "replay")
    out = {"trace": spec.trace, "requests": reports[0]["requests"], "page_size": cache.page_size,
           "device_pages": cache.device_pages, "host_pages": cache.host_pages,
           "l3_capacity": args.l3_capacity, "page_bytes": reports[0]["page_bytes"],
           **rank_figures(args, reports, run_id, seconds, storage["name"] if storage else "none")}
    hits = out["tokens_from_l1"] + out["tokens_from_l2"] + out["tokens_from_l3"]
    prompt = max(1, out["prompt_tokens"])
    out.update({
        "hit_ratio": round(hits / prompt, 4), "oracle_tokens": oracle.tokens,
        "oracle_ratio": round(oracle.tokens / prompt, 4),
        "oracle_captured": round(hits / oracle.tokens, 4) if oracle.tokens else None,
        "distinct_pages": oracle.distinct_pages,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reports),
        "virtual_seconds": reports[0]["virtual_seconds"],
        "model": spec.hardware.model, "kv_bytes_per_token": spec.hardware.token_bytes,
        "hardware": spec.hardware.resolved(),
    })
    out["admission_us_p50"], out["admission_us_p99"] = p50_p99([us for r in reports for us in r["admission_us"]])
    out.update(ttft_beside(trace, spec, cache, reports[0], reusable, out["prompt_tokens"]))
    out["lost_tokens"] = lost_tokens(trace, reusable, reports[0]["cached_tokens"], reports[0]["miss_reasons"],
                                     reports[0]["l3_pages_from_before"] * cache.page_size)
    check_account(out["lost_tokens"], oracle.tokens, hits)
    return out


def ttft_beside(trace, spec: ReplaySpec, cache: CacheConfig, report: dict, reusable: dict[int, int],
                prompt_tokens: int) -> dict:
    """The replay's TTFT and throughput beside the same trace's with no cache and with the
    ideal cache, each timed by the same scheduler on the virtual clock."""
    baseline = timed_run(trace, spec, cache.page_size, cache.device_pages)
    ideal = timed_run(trace, spec, cache.page_size, cache.device_pages, free=reusable)
    out = {}
    for prefix, ttft_us, last_us in (("", report["ttft_us"], report["last_forward_us"]),
                                     ("baseline_", baseline.ttft_us, baseline.last_us),
                                     ("oracle_", ideal.ttft_us, ideal.last_us)):
        out.update(ttft_figures(prefix, ttft_us, prompt_tokens, last_us))
    gain = out["baseline_ttft_ms_p90"] - out["oracle_ttft_ms_p90"]
    out["ttft_p90_reduction_captured"] = (
        round((out["baseline_ttft_ms_p90"] - out["ttft_ms_p90"]) / gain, 4) if gain > 0 else None)
    return out


def ttft_figures(prefix: str, ttft_us, prompt_tokens: int, last_us: float) -> dict:
    """TTFT percentiles in ms and prompt tokens a second (from the trace's start to the last
    forward pass), under `prefix`."""
    cuts = statistics.quantiles(ttft_us, n=100, method="inclusive") if len(ttft_us) > 1 else [ttft_us[0]] * 99
    out = {f"{prefix}ttft_ms_p{q}": round(cuts[q - 1] / 1e3, 2) for q in QUANTILES}
    out[f"{prefix}prompt_tokens_per_s"] = round(prompt_tokens / (last_us / 1e6), 1)
    return out


def print_summary(result: dict, file=None) -> None:
    file = file or sys.stdout
    prompt = max(1, result["prompt_tokens"])
    print(f"hicache-async replay {os.path.basename(result['trace'])}: {result['requests']} requests, "
          f"world {result['world_size']} (tp{result['tp']} pp{result['pp']} cp{result['cp']}), storage "
          f"{result['storage_used']}{' (sealed)' if result['storage_sealed'] else ''}, pages of "
          f"{result['page_size']} tokens ({result['page_bytes']} B a rank)",
          file=file)
    print(f"  {'tier':<12}{'tokens':>14}{'share':>9}", file=file)
    for key, name in TIER_NAMES:
        print(f"  {name:<12}{result[key]:>14,}{result[key] / prompt:>9.1%}", file=file)
    print(f"  {'prompt':<12}{result['prompt_tokens']:>14,}", file=file)
    captured = result["oracle_captured"]
    print(f"  hit ratio {result['hit_ratio']:.3f}; unbounded-cache oracle {result['oracle_ratio']:.3f} "
          f"({result['oracle_tokens']:,} tokens, {result['distinct_pages']:,} distinct pages)"
          + (f"; {captured:.1%} of the possible reuse served" if captured is not None else ""), file=file)
    print_planner(result, file)
    print(f"  KV verified: {result['kv_verified_pages']:,} pages, {result['kv_mismatches']} mismatches; "
          f"ranks agree: {'yes' if result['ranks_agree'] else 'NO'}", file=file)
    print(f"  pools: device {result['device_pages']} pages, host {result['host_pages']} pages; storage errors "
          f"{result['storage_errors']}, corrupt objects {result['corrupt_objects']}, forged objects "
          f"{result['forged_objects']}, missing objects "
          f"{result['missing_objects']}, L3 written {result['l3_bytes_written'] / 2**20:,.1f} MiB, "
          f"read {result['l3_bytes_read'] / 2**20:,.1f} MiB", file=file)
    print(f"  admission p50 {result['admission_us_p50']} us, p99 {result['admission_us_p99']} us; on_step "
          f"p50 {result['on_step_us_p50']} us, p99 {result['on_step_us_p99']} us; peak RSS "
          f"{result['peak_rss_mb']} MiB", file=file)
    print(f"  {result['forwards']:,} forwards, {result['virtual_seconds']:,.1f} s virtual, "
          f"{result['seconds']} s wall; run id {result['run_id']}", file=file)


def print_planner(result: dict, file) -> None:
    """The modelled hardware, TTFT beside no cache and the ideal cache, and the loss account."""
    hw = result["hardware"]
    print(f"  modelled: {hw['model']} ({hw['kv_bytes_per_token']:,} B of KV a token), prefill "
          f"{hw['prefill_us_per_token']:g} us a token, decode step {hw['decode_us_per_step'] / 1e3:g} ms; "
          f"PCIe {hw['pcie_gbps']:g} GB/s, L3 read {hw['l3_read_gbps']:g} GB/s, write "
          f"{hw['l3_write_gbps']:g} GB/s, {hw['l3_latency_us']:g} us a call", file=file)
    print(f"  {'TTFT':<12}{'p50 ms':>12}{'p90 ms':>12}{'p99 ms':>12}{'prompt tok/s':>15}", file=file)
    for prefix, name in CACHES:
        print(f"  {name:<12}" + "".join(f"{result[f'{prefix}ttft_ms_p{q}']:>12,.1f}" for q in QUANTILES)
              + f"{result[f'{prefix}prompt_tokens_per_s']:>15,.0f}", file=file)
    captured = result["ttft_p90_reduction_captured"]
    if captured is not None and captured >= 0:
        print(f"  this configuration gets {captured:.1%} of the TTFT p90 reduction the ideal cache would", file=file)
    elif captured is not None:
        print(f"  this configuration's TTFT p90 is worse than with no cache, where the ideal cache would cut it "
              f"by {result['baseline_ttft_ms_p90'] - result['oracle_ttft_ms_p90']:,.1f} ms", file=file)
    lost = {reason: tokens for reason, tokens in result["lost_tokens"].items() if tokens > 0}
    if lost:
        total = sum(lost.values())
        print(f"  reusable tokens computed anyway: {total:,}: " + ", ".join(
            f"{reason.replace('_', ' ')} {tokens:,} ({tokens / total:.0%})" for reason, tokens in lost.items()),
            file=file)
    if result["lost_tokens"].get(EARLIER):
        print(f"  beyond the oracle: {-result['lost_tokens'][EARLIER]:,} tokens from pages L3 held before the run",
              file=file)
