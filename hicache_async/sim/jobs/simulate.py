"""`hicache-async simulate`: the multi-turn workload on simulated ranks, checked against a
cache-less single-rank run of the same engine."""
from __future__ import annotations

import os
import sys
import tempfile

from ...config import CacheConfig
from ...engine.tiny.model import ModelConfig
from ...engine.tiny.workload import WorkloadSpec
from ...errors import UsageError
from ...topology import check_topology
from ..ranks import torchrun
from .harness import RunArgs, launch_ranks, rank_figures, storage_spec
from .reference import reference_run
from .simulate_rank import payload_of


def run(args: RunArgs, cache: CacheConfig, spec: WorkloadSpec, model: ModelConfig) -> dict:
    check_topology(args.tp, args.pp, args.cp, num_layers=model.layers, kv_heads=model.kv_heads,
                   attention=model.attention, q_heads=model.q_heads)
    torchrun.check_world(args.tp, args.pp, args.cp)
    if cache.page_size > spec.system_len:
        raise UsageError(f"--page-size {cache.page_size} exceeds the shortest prompt ({spec.system_len} "
                         f"tokens): few pages would ever fill, so little could be cached")
    if spec.max_prompt() // cache.page_size + 1 > cache.device_pages:
        raise UsageError(f"--device-pages {cache.device_pages} cannot hold one request of up to "
                         f"{spec.max_prompt() + spec.max_new} tokens at --page-size {cache.page_size}")
    with storage_spec(args) as storage, tempfile.TemporaryDirectory(prefix="hicache-kv-") as kv_dir:
        reference, recorder = reference_run(model, spec, cache.page_size)   # after storage: fail fast
        payload = payload_of(model, cache, spec, storage)
        payload["kv_reference"] = os.path.join(kv_dir, "reference")
        recorder.save(payload["kv_reference"])
        reports, run_id, cached_s = launch_ranks(args, "hicache_async.sim.jobs.simulate_rank:run_rank", payload,
                                                 spec.requests, "simulate", scratch=kv_dir)
    backend = storage["name"] if storage else "none"
    result = summarize(args, model.attention, reports, reference, run_id, cached_s, backend)
    result["tenants"] = spec.tenants
    return result


def summarize(args: RunArgs, attention: str, reports: list[dict], reference: dict, run_id: str,
              seconds: float, storage_used: str) -> dict:
    first = reports[0]
    return {"attention": attention, "requests": len(first["outputs"]),
            "outputs_match_reference": first["outputs"] == reference,
            **rank_figures(args, reports, run_id, seconds, storage_used)}


def print_summary(result: dict, file=None) -> None:
    file = file or sys.stdout
    tiers = result["tiers"]
    print(f"hicache-async simulate: world {result['world_size']} (tp{result['tp']} pp{result['pp']} "
          f"cp{result['cp']}), {result['attention']}, storage {result['storage']}"
          + (" (sealed)" if result["storage_sealed"] else ""), file=file)
    print(f"  requests {result['requests']}, prompt tokens {result['prompt_tokens']}: " + ", ".join(
        f"{name} {t['tokens']} ({t['share']:.0%})" for name, t in tiers.items()), file=file)
    print(f"  transfers {result['transfers']}, storage errors {result['storage_errors']}, corrupt objects "
          f"{result['corrupt_objects']}, forged objects {result['forged_objects']}, missing objects "
          f"{result['missing_objects']}, L3 bytes written "
          f"{result['l3_bytes_written']}, read {result['l3_bytes_read']}", file=file)
    print(f"  steps {result['steps']}, on_step p50 {result['on_step_us_p50']} us, "
          f"p99 {result['on_step_us_p99']} us, {result['seconds']} s", file=file)
    verdict = "yes" if result["outputs_match_reference"] else "NO"
    print(f"  KV verified against the reference: {result['kv_verified_pages']} pages, "
          f"{result['kv_mismatches']} mismatches; ranks agree: {'yes' if result['ranks_agree'] else 'NO'}",
          file=file)
    print(f"  outputs match the cache-less reference: {verdict}; run id {result['run_id']} "
          f"(the hicache.run_id attribute of its traces)", file=file)
