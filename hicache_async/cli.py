"""`hicache-async`: simulate and bench. Usage errors exit 2 with one line; failures exit 1."""
from __future__ import annotations

import argparse
import json
import sys

from . import faults
from .config import KEY_SCHEMES, PREFETCH_POLICIES, WRITE_POLICIES, CacheConfig
from .errors import HiCacheError, UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _check_metadata_url(url: str) -> None:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise UsageError(f"--mooncake-metadata must be http://HOST:PORT/metadata, got {url!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sim = sub.add_parser("simulate", help="run the multi-turn workload on simulated ranks")
    for flag in ("--tp", "--pp", "--cp"):
        sim.add_argument(flag, type=_positive, default=1)
    sim.add_argument("--attention", choices=("mha", "mla"), default="mha")
    sim.add_argument("--storage", choices=("memory", "file", "mooncake", "none"), default="file")
    sim.add_argument("--storage-path", help="file storage directory (default: a per-user cache directory)")
    sim.add_argument("--mooncake-master", metavar="HOST:PORT",
                     help="use this master (and its segment holder) instead of starting one for the run")
    sim.add_argument("--mooncake-metadata", metavar="URL",
                     help="that master's metadata server (default http://HOST:8080/metadata)")
    sim.add_argument("--requests", type=_positive, default=48)
    sim.add_argument("--turns", type=_positive, default=4)
    sim.add_argument("--max-new", type=_positive, default=8)
    sim.add_argument("--device-pages", type=_positive, default=48)
    sim.add_argument("--host-pages", type=_positive, default=192)
    sim.add_argument("--page-size", type=_positive, default=16)
    sim.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through")
    sim.add_argument("--prefetch-policy", choices=PREFETCH_POLICIES, default="timeout")
    sim.add_argument("--prefetch-threshold", type=_non_negative, default=256, metavar="TOKENS")
    sim.add_argument("--key-scheme", choices=KEY_SCHEMES, default="rank-suffix")
    sim.add_argument("--cp-transfer", choices=("split", "rank0"), default="split")
    sim.add_argument("--storage-optional", action="store_true",
                     help="if the storage is unreachable at start, warn and run on L1/L2 only")
    sim.add_argument("--seed", type=_non_negative, default=0)
    sim.add_argument("--timeout", type=float, default=60.0, help="seconds any cross-rank wait may take")
    sim.add_argument("--json", metavar="PATH")
    sim.add_argument("--trace-file", metavar="PATH", help="also write spans as OTLP JSON here")
    sim.add_argument("--log-json", action="store_true")
    bench = sub.add_parser("bench", help="run the benchmark suite")
    bench.add_argument("--json", metavar="PATH")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions")
    bench.add_argument("--only", metavar="NAME", action="append", help="run only these figures")
    return parser


def _simulate(ns: argparse.Namespace) -> int:
    from .engine.model import ModelConfig
    from .engine.workload import WorkloadSpec
    from .simulate import SimulateArgs, print_summary, run

    if ns.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {ns.timeout}")
    if ns.mooncake_master and ns.storage != "mooncake":
        raise UsageError(f"--mooncake-master {ns.mooncake_master} needs --storage mooncake")
    if ns.mooncake_metadata and not ns.mooncake_master:
        raise UsageError(f"--mooncake-metadata {ns.mooncake_metadata} needs --mooncake-master")
    if ns.mooncake_metadata:
        _check_metadata_url(ns.mooncake_metadata)
    cache = CacheConfig(device_pages=ns.device_pages, host_pages=ns.host_pages, page_size=ns.page_size,
                        write_policy=ns.write_policy, prefetch_policy=ns.prefetch_policy,
                        prefetch_threshold=ns.prefetch_threshold, key_scheme=ns.key_scheme,
                        cp_transfer=ns.cp_transfer, sync_timeout_s=ns.timeout)
    spec = WorkloadSpec(requests=ns.requests, turns=ns.turns, max_new=ns.max_new, seed=ns.seed)
    model = ModelConfig(attention=ns.attention, seed=ns.seed)
    args = SimulateArgs(tp=ns.tp, pp=ns.pp, cp=ns.cp, attention=ns.attention, storage=ns.storage,
                        storage_path=ns.storage_path, mooncake_master=ns.mooncake_master,
                        mooncake_metadata=ns.mooncake_metadata,
                        requests=ns.requests, seed=ns.seed, timeout_s=ns.timeout, trace_file=ns.trace_file,
                        log_json=ns.log_json, storage_optional=ns.storage_optional)
    result = run(args, cache, spec, model)
    print_summary(result)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return _verdict(result)


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
    if not result["outputs_match_reference"]:
        print("hicache-async: error: cached outputs differ from the cache-less reference", file=sys.stderr)
        return 1
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from .bench import run_bench

    figures = run_bench(quick=ns.quick, only=ns.only)
    for fig in figures:
        print(f"{fig['name']:28s} {fig['value']:>12.3f} {fig['unit']:6s} vs {fig['baseline_name']} "
              f"{fig['baseline_value']:.3f}  ratio {fig['ratio']:.3f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        ns = build_parser().parse_args(argv)
        faults.injected()       # an unknown fault name is a usage error before any work starts
        return {"simulate": _simulate, "bench": _bench}[ns.command](ns)
    except UsageError as exc:
        print(f"hicache-async: error: {exc}", file=sys.stderr)
        return 2
    except HiCacheError as exc:
        print(f"hicache-async: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hicache-async: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
