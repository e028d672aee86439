"""`hicache-async simulate`: the multi-turn workload on simulated ranks, checked against a
cache-less single-rank run of the same engine."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from tqdm import tqdm

from ..config import CacheConfig
from ..engine.model import ModelConfig
from ..engine.workload import WorkloadSpec
from ..errors import StorageError, UsageError
from ..parallel.topology import check_topology
from ..storage.base import DEFAULT_STORAGE, storage_backend
from ..telemetry.trace_file import merge_trace_files, part_path
from . import torchrun
from .launcher import launch
from .rank_main import payload_of
from .reference import reference_run

TOKEN_FIELDS = ("tokens_from_l1", "tokens_from_l2", "tokens_from_l3", "tokens_computed")
STORAGE_COUNTS = ("storage_errors", "corrupt_objects", "forged_objects", "missing_objects", "l3_bytes_written",
                  "l3_bytes_read")


@dataclass
class RunArgs:
    """Topology, storage and telemetry of a run on simulated ranks: `simulate` and `replay`."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    storage: str = DEFAULT_STORAGE
    storage_options: dict = field(default_factory=dict)   # the backend's own flags, by dest
    l3_capacity: int | None = None     # bytes; only backends that take a capacity
    timeout_s: float = 60.0
    trace_file: str | None = None
    log_json: bool = False
    storage_optional: bool = False
    storage_secret_file: str | None = None   # seal every stored object with the key derived from it


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
        reports, run_id, cached_s = launch_ranks(args, "hicache_async.sim.rank_main:run_rank", payload,
                                                 spec.requests, "simulate", scratch=kv_dir)
    return summarize(args, model.attention, reports, reference, run_id, cached_s, storage["name"] if storage else "none")


def launch_ranks(args: RunArgs, target: str, payload: dict, requests: int, job: str,
                 scratch: str | None = None) -> tuple[list[dict], str, float]:
    """Run `target` on every rank with a progress bar over `requests`; (reports, run id, seconds).

    Our launcher starts the ranks, or, under torchrun, this process is rank 0 of those it
    started; `scratch` is a directory the payload names files in, sent to every rank.
    Adds the telemetry settings to `payload` and merges the ranks' span files afterwards.
    """
    payload = {**payload, "trace_file": args.trace_file, "log_json": args.log_json}
    run_id = uuid.uuid4().hex[:16]
    started = time.perf_counter()
    with tqdm(total=requests, desc=f"{job} tp{args.tp} pp{args.pp} cp{args.cp}",
              unit="req", file=sys.stderr, disable=None) as bar:
        ranks = dict(tp=args.tp, pp=args.pp, cp=args.cp, target=target, payload=payload, run_id=run_id,
                     timeout_s=args.timeout_s, on_progress=lambda info: bar.update(info["requests_done"] - bar.n))
        reports = torchrun.lead(**ranks, scratch=scratch) if torchrun.environment() else launch(**ranks)
    seconds = time.perf_counter() - started
    if args.trace_file:
        world = args.tp * args.pp * args.cp
        merge_trace_files([part_path(args.trace_file, r) for r in range(world)], args.trace_file)
    return reports, run_id, seconds


@contextlib.contextmanager
def storage_spec(args: RunArgs, cold: bool = False):
    """The storage every rank opens ({"name", "options"}, or None for no L3), set up once for
    the run by the backend's own session (`StorageAdapter.open_session`). `cold`: the run
    wants an L3 that starts empty unless the backend's options name a shared one."""
    backend = None if args.storage == "none" else storage_backend(args.storage)
    if args.storage_secret_file and backend is None:
        raise UsageError(f"--storage-secret-file {args.storage_secret_file} needs a storage to seal")
    if args.l3_capacity is not None and not (backend and backend.takes_capacity):
        raise UsageError(f"--l3-capacity {args.l3_capacity}: the {args.storage} storage has no capacity "
                         f"to bound")
    if backend is None:
        yield None
        return
    with contextlib.ExitStack() as stack:
        try:
            options = stack.enter_context(backend.open_session(
                args.storage_options, capacity_bytes=args.l3_capacity, cold=cold))
        except StorageError as exc:
            if not args.storage_optional:
                raise
            print(f"hicache-async: warning: {exc}; running on L1/L2 only (--storage-optional)", file=sys.stderr)
            options = None
        if options is None:
            yield None
        else:   # the secret's path, never the secret: each rank reads it itself
            yield {"name": args.storage, "options": options, "secret_file": args.storage_secret_file}


def summarize(args: RunArgs, attention: str, reports: list[dict], reference: dict, run_id: str,
              seconds: float, storage_used: str) -> dict:
    first = reports[0]
    return {"attention": attention, "requests": len(first["outputs"]),
            "outputs_match_reference": first["outputs"] == reference,
            **rank_figures(args, reports, run_id, seconds, storage_used)}


def rank_figures(args: RunArgs, reports: list[dict], run_id: str, seconds: float, storage_used: str) -> dict:
    """What every run reports from its ranks' reports: topology, tiers, KV checks, agreement,
    step times, transfers and storage counters."""
    first = reports[0]
    # The cache decisions (digest, transfers) are each rank's own and must agree.
    ranks_agree = all(r["digest"] == first["digest"] and r["transfers"] == first["transfers"]
                      for r in reports)
    mismatch = next((r["kv_first_mismatch"] for r in reports if r["kv_first_mismatch"]), None)
    step_p50, step_p99 = p50_p99([us for r in reports for us in r["step_us"]])
    out = {
        "world_size": args.tp * args.pp * args.cp, "tp": args.tp, "pp": args.pp, "cp": args.cp,
        "storage": args.storage, "storage_used": storage_used,
        "storage_sealed": storage_used != "none" and args.storage_secret_file is not None, "run_id": run_id,
        "prompt_tokens": first["prompt_tokens"],
        **{k: first[k] for k in TOKEN_FIELDS},
        "ranks_agree": ranks_agree,
        "kv_verified_pages": sum(r["kv_verified_pages"] for r in reports),
        "kv_mismatches": sum(r["kv_mismatches"] for r in reports),
        "kv_first_mismatch": mismatch,
        "steps": first["steps"], "forwards": first["forwards"],
        "on_step_us_p50": step_p50, "on_step_us_p99": step_p99,
        "transfers": first["transfers"],
        **{k: sum(r[k] for r in reports) for k in STORAGE_COUNTS},
        "dropped_pages": first["dropped_pages"],
        "most_pending_sends": max(r["most_pending_sends"] for r in reports),
        "seconds": round(seconds, 2),
    }
    total = max(1, out["prompt_tokens"])
    out["tiers"] = {k.removeprefix("tokens_").removeprefix("from_"): {
        "tokens": out[k], "share": round(out[k] / total, 4)} for k in TOKEN_FIELDS}
    return out


def p50_p99(values: list[float]) -> tuple[float, float]:
    """Median and 99th percentile, rounded to 0.1; zeros for fewer than two values."""
    cuts = statistics.quantiles(values, n=100) if len(values) > 1 else [0.0] * 99
    return round(cuts[49], 1), round(cuts[98], 1)


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
