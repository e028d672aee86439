"""`hicache-async replay TRACE`: a Mooncake-format trace served through the real plugin on the
replay engine across simulated ranks, every reused page verified, beside an unbounded-cache
oracle computed here from the trace alone."""
from __future__ import annotations

import dataclasses
import os
import sys

from ..config import CacheConfig
from ..engine.replay_model import ReplayModelSpec
from ..engine.replay_trace import read_trace
from ..engine.replay_workload import ReplaySpec
from ..errors import UsageError
from ..parallel.topology import check_topology
from ..request import pages_needed
from . import torchrun
from .oracle import unbounded_oracle
from .simulate import TOKEN_FIELDS, RunArgs, launch_ranks, p50_p99, rank_figures, storage_spec

TIER_NAMES = tuple(zip(TOKEN_FIELDS, ("L1 device", "L2 host", "L3 storage", "computed")))


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
    oracle = unbounded_oracle(trace, cache.page_size, spec.seed)
    with storage_spec(args, cold=True) as storage:   # a trace is measured from an empty L3
        payload = {"cache": dataclasses.asdict(cache), "replay": spec.to_dict(),
                   "model": dataclasses.asdict(model), "storage": storage}
        reports, run_id, seconds = launch_ranks(args, "hicache_async.sim.replay_rank:run_rank", payload,
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
    })
    out["admission_us_p50"], out["admission_us_p99"] = p50_p99([us for r in reports for us in r["admission_us"]])
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
