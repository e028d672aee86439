"""`hicache-async`: simulate, replay, bench, and the commands installed packages add (`route`).
Usage errors exit 2 with one line; failures exit 1."""
from __future__ import annotations

import argparse
import json
import os
import sys

from .. import faults
from ..config import CP_MODES, KEY_SCHEMES, PREFETCH_POLICIES, WRITE_POLICIES, CacheConfig
from ..errors import HiCacheError, UsageError
from . import sleeping_workers
from .extensions import COMMANDS, installed
from .hardware_flags import add_hardware_flags, hardware_model
from .storage_flags import add_storage_flags, storage_options


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def _number(parse, what: str, ok):
    """An argparse type: `parse` the text, and name what was expected when it fails or not `ok`."""
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return check


_positive = _number(int, "a positive integer", lambda v: v > 0)
_non_negative = _number(int, "an integer >= 0", lambda v: v >= 0)
_non_negative_float = _number(float, "a number >= 0", lambda v: 0 <= v < float("inf"))


def _size(text: str) -> int:
    from ..sim.jobs.capacity import parse_size

    try:
        return parse_size(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """Topology, cache, storage and telemetry flags: the same for every job on simulated ranks."""
    for flag in ("--tp", "--pp", "--cp"):
        p.add_argument(flag, type=_positive, default=1)
    add_storage_flags(p)
    p.add_argument("--l3-capacity", type=_size, metavar="BYTES",
                   help="bound L3 at this size, e.g. 512M or 2G, for a storage that takes one; LRU beyond it")
    p.add_argument("--device-pages", type=_positive)
    p.add_argument("--host-pages", type=_positive)
    p.add_argument("--page-size", type=_positive)
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through")
    p.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="timeout")
    p.add_argument("--prefetch-threshold", type=_non_negative, metavar="TOKENS",
                   help="prefetch from L3 only when at least this many tokens are missing (default: "
                        "when fetching is expected to be cheaper than recomputing)")
    p.add_argument("--prefill-us-per-token", type=_non_negative_float, metavar="US",
                   help="the engine's prefill cost per prompt token: what an L3 prefetch must beat "
                        "(replay: also the virtual clock's cost; default simulate 50, replay the model's)")
    p.add_argument("--key-scheme", choices=KEY_SCHEMES, default="rank-suffix")
    p.add_argument("--cp-transfer", choices=CP_MODES, default="split")
    p.add_argument("--storage-optional", action="store_true",
                   help="if the storage is unreachable at start, warn and run on L1/L2 only")
    p.add_argument("--storage-secret-file", metavar="PATH",
                   help="seal every stored object (AES-256-GCM) with a key derived from this file of at "
                        "least 32 random bytes, readable by its owner only")
    p.add_argument("--storage-timeout", type=_number(float, "a number > 0", lambda v: 0 < v < float("inf")),
                   default=CacheConfig.storage_timeout_s, metavar="SECONDS",
                   help="a storage call still running after this is given up on: a storage error")
    p.add_argument("--seed", type=_non_negative, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any cross-rank wait may take")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--trace-file", metavar="PATH", help="also write spans as OTLP JSON here")
    p.add_argument("--log-json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sim = sub.add_parser("simulate", help="run the multi-turn workload on simulated ranks")
    _add_run_flags(sim)
    sim.set_defaults(device_pages=48, host_pages=192, page_size=16,
                     prefill_us_per_token=CacheConfig.prefill_us_per_token)
    sim.add_argument("--l3-gbps", type=_number(float, "a number > 0", lambda v: 0 < v < float("inf")),
                     default=CacheConfig.l3_gbps, metavar="GB/S",
                     help="L3 throughput assumed until prefetches measure it")
    sim.add_argument("--attention", choices=("mha", "mla"), default="mha")
    sim.add_argument("--requests", type=_positive, default=48)
    sim.add_argument("--turns", type=_positive, default=4)
    sim.add_argument("--max-new", type=_positive, default=8)
    sim.add_argument("--tenants", type=_positive, default=1,
                     help="spread conversations over this many tenants (cache salts)")
    rep = sub.add_parser("replay", help="serve a Mooncake-format trace, every reused page verified")
    rep.add_argument("trace", metavar="TRACE", help="JSONL: timestamp, input_length, output_length, hash_ids")
    _add_run_flags(rep)
    rep.set_defaults(device_pages=4096, host_pages=16384, page_size=64, l3_gbps=CacheConfig.l3_gbps)
    add_hardware_flags(rep)
    rep.add_argument("--limit", type=_positive, metavar="N", help="replay the first N requests")
    rep.add_argument("--max-output", type=_positive, metavar="TOKENS",
                     help="cap each request's output_length (default: honour it)")
    rep.add_argument("--decode-us-per-step", type=_non_negative_float, metavar="US",
                     help="virtual cost of each forward pass, a decode step (default: the model's)")
    rep.add_argument("--sweep", metavar="NAME=A,B,C",
                     help="replay once per value of host-pages, device-pages, l3-capacity or a hardware "
                          "flag (pcie-gbps, l3-read-gbps, l3-write-gbps, l3-latency-us, kv-bytes-per-token)")
    rep.add_argument("--csv", metavar="PATH", help="the sweep's table as CSV (default: beside --json)")
    rep.add_argument("--plot", metavar="PATH.png",
                     help="draw the sweep's hit ratio and TTFT p90 (needs the plot extra)")
    bench = sub.add_parser("bench", help="run the benchmark suite")
    bench.add_argument("--json", metavar="PATH")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--only", metavar="NAME", action="append", help="run only these figures")
    for name, ep in installed(COMMANDS).items():
        command = ep.load()
        p = sub.add_parser(name, help=command.help)
        command.add_flags(p)
        p.set_defaults(installed_command=command.run)
    return parser


def _cache_config(ns: argparse.Namespace, prefill_us_per_token: float | None = None) -> CacheConfig:
    """The cache flags as a config; `prefill_us_per_token` when the flag's default is a model's."""
    if ns.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {ns.timeout}")
    return CacheConfig(device_pages=ns.device_pages, host_pages=ns.host_pages, page_size=ns.page_size,
                       write_policy=ns.write_policy, prefetch_policy=ns.prefetch_policy,
                       prefetch_threshold=ns.prefetch_threshold, key_scheme=ns.key_scheme,
                       cp_transfer=ns.cp_transfer, sync_timeout_s=ns.timeout,
                       prefill_us_per_token=ns.prefill_us_per_token if prefill_us_per_token is None
                       else prefill_us_per_token, l3_gbps=ns.l3_gbps, storage_timeout_s=ns.storage_timeout)


def _run_args(ns: argparse.Namespace):
    from ..sim.jobs.harness import RunArgs

    if ns.storage_secret_file:
        from ..storage.sealed import load_key

        load_key(ns.storage_secret_file)     # a bad secret file is one line here, before any rank
    return RunArgs(
        tp=ns.tp, pp=ns.pp, cp=ns.cp, storage=ns.storage, storage_options=storage_options(ns),
        l3_capacity=ns.l3_capacity, timeout_s=ns.timeout, trace_file=ns.trace_file, log_json=ns.log_json,
        storage_optional=ns.storage_optional, storage_secret_file=ns.storage_secret_file)


def _write_json(result, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _simulate(ns: argparse.Namespace) -> int:
    from ..engine.tiny.model import ModelConfig
    from ..engine.tiny.workload import WorkloadSpec
    from ..sim.jobs.simulate import print_summary, run

    cache = _cache_config(ns)
    spec = WorkloadSpec(requests=ns.requests, turns=ns.turns, max_new=ns.max_new, seed=ns.seed, tenants=ns.tenants)
    model = ModelConfig(attention=ns.attention, seed=ns.seed)
    args = _run_args(ns)
    result = run(args, cache, spec, model)
    print_summary(result)
    _write_json(result, ns.json)
    return _verdict(result)


def _replay(ns: argparse.Namespace) -> int:
    from ..engine.replay.workload import ReplaySpec
    from ..sim.jobs import capacity, sweep_plot
    from ..sim.jobs.replay import print_summary, run

    spec = ReplaySpec(trace=ns.trace, limit=ns.limit, seed=ns.seed, max_output=ns.max_output,
                      hardware=hardware_model(ns))
    cache = _cache_config(ns, spec.costs.prefill_us_per_token)
    args = _run_args(ns)
    if not ns.sweep:
        if ns.plot or ns.csv:
            raise UsageError(f"{'--plot' if ns.plot else '--csv'} needs --sweep NAME=A,B,C")
        result = run(args, cache, spec)
        print_summary(result)
        _write_json(result, ns.json)
        return _verdict(result)
    name, values = capacity.parse_sweep(ns.sweep, ns.storage)
    if ns.plot:
        sweep_plot.require_matplotlib()
    table = capacity.sweep(args, cache, spec, name, values, on_run=print_summary)
    _write_json(table, ns.json)
    csv_path = ns.csv or (os.path.splitext(ns.json)[0] + ".csv" if ns.json else None)
    if csv_path:
        capacity.write_csv(table, csv_path)
    if ns.plot:
        sweep_plot.plot(table, ns.plot)
    capacity.print_table(table)
    return max(_verdict(r) for r in table["runs"])


def _verdict(result: dict) -> int:
    """A run passes only when its KV, its ranks and its tokens all check out."""
    if result["kv_mismatches"]:
        more = result["kv_mismatches"] - 1
        print(f"hicache-async: error: {result['kv_first_mismatch']}"
              + (f" (and {more} more mismatched pages)" if more else ""), file=sys.stderr)
        return 1
    if not result["ranks_agree"]:
        print("hicache-async: error: ranks made different cache decisions", file=sys.stderr)
        return 1
    if not result.get("outputs_match_reference", True):
        print("hicache-async: error: cached outputs differ from the cache-less reference", file=sys.stderr)
        return 1
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from .bench import run_bench

    figures = run_bench(quick=ns.quick, only=ns.only)
    for fig in figures:
        if fig.get("skipped"):
            print(f"{fig['name']:28s} skipped: {fig['skipped']}")
            continue
        ratio = "n/a" if fig["ratio"] is None else f"{fig['ratio']:.3f}"
        goal = f"  goal <= {fig['goal_max_ratio']}: {fig['goal_met']}" if "goal_met" in fig else ""
        print(f"{fig['name']:28s} {fig['value']:>12.3f} {fig['unit']:6s} vs {fig['baseline_name']} "
              f"{fig['baseline_value']:.3f}  ratio {ratio}{goal}")
    _write_json(figures, ns.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:        # run as the command, not called in-process
        sleeping_workers()
    try:
        ns = build_parser().parse_args(argv)
        faults.injected()       # an unknown fault name is a usage error before any work starts
        if ns.command == "bench":
            return _bench(ns)
        if hasattr(ns, "installed_command"):
            return ns.installed_command(ns)
        from ..sim.ranks.torchrun import lead_or_follow  # under torchrun this process is one rank
        return lead_or_follow(lambda: {"simulate": _simulate, "replay": _replay}[ns.command](ns))
    except UsageError as exc:
        print(f"hicache-async: error: {exc}", file=sys.stderr)
        return 2
    except HiCacheError as exc:
        print(f"hicache-async: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hicache-async: interrupted", file=sys.stderr)
        return 130

