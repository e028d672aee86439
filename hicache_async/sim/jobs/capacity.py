"""Capacity planning: one replay per capacity value, hit ratio per tier against capacity.

The answer a user wants is "with X of host memory and this L3, this traffic gets Y% of the
reuse it could get": each row puts the tiers' shares of the prompt tokens beside the
unbounded-cache oracle of the same trace.
"""
from __future__ import annotations

import csv
import dataclasses
import re

from ...config import CacheConfig
from ...engine.replay.model import ReplayModelSpec
from ...engine.replay.workload import ReplaySpec
from ...errors import UsageError
from ...storage.base import storage_backend
from .harness import RunArgs
from .replay import run

# --sweep NAME -> (where the value goes, what it counts)
SWEEPABLE = {"host-pages": ("cache", "host_pages"), "device-pages": ("cache", "device_pages"),
             "l3-capacity": ("args", "l3_capacity")}
RUN_FIELDS = ("hit_ratio", "oracle_ratio", "kv_verified_pages", "kv_mismatches", "seconds")
COLUMNS = ("value", "capacity_mib", "l1_ratio", "l2_ratio", "l3_ratio", *RUN_FIELDS)


def parse_size(text: str) -> int:
    """Bytes from `123`, `64K`, `512M`, `2G` (binary multiples); a usage error otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise UsageError(f"expected a positive size like 4096, 512M or 2G, got {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def parse_sweep(text: str, storage: str) -> tuple[str, list[int]]:
    """`NAME=A,B,C` -> (NAME, [A, B, C]); names the bad part when it is not one."""
    name, sep, values = text.partition("=")
    if name not in SWEEPABLE or not sep:
        raise UsageError(f"--sweep {text!r}: expected NAME=A,B,C with NAME one of {', '.join(SWEEPABLE)}")
    if name == "l3-capacity" and (storage == "none" or not storage_backend(storage).takes_capacity):
        raise UsageError(f"--sweep {name}: the {storage} storage has no capacity to sweep")
    try:
        parsed = [parse_size(v) if name == "l3-capacity" else int(v) for v in values.split(",")]
    except (ValueError, UsageError):
        parsed = []
    if not parsed or any(v <= 0 for v in parsed):
        raise UsageError(f"--sweep {text!r}: expected positive integers after {name}=")
    return name, sorted(set(parsed))


def sweep(args: RunArgs, cache: CacheConfig, spec: ReplaySpec, name: str, values: list[int],
          model: ReplayModelSpec = ReplayModelSpec(), on_run=lambda result: None) -> dict:
    """Replay once per value (each from a cold L3 unless --storage-path names one)."""
    where, field = SWEEPABLE[name]
    runs = []
    for value in values:
        run_args = dataclasses.replace(args, **{field: value}) if where == "args" else args
        run_cache = dataclasses.replace(cache, **{field: value}) if where == "cache" else cache
        result = run(run_args, run_cache, spec, model)
        on_run(result)
        runs.append(result)
    return {"sweep": name, "rows": [_row(name, value, r) for value, r in zip(values, runs)], "runs": runs}


def _row(name: str, value: int, result: dict) -> dict:
    nbytes = value if name == "l3-capacity" else value * result["page_bytes"]
    return {"value": value, "capacity_mib": round(nbytes / 2**20, 2),
            **{f"{tier}_ratio": result["tiers"][tier]["share"] for tier in ("l1", "l2", "l3")},
            **{k: result[k] for k in RUN_FIELDS}}


def write_csv(table: dict, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=(table["sweep"], *COLUMNS[1:]))
        writer.writeheader()
        for row in table["rows"]:
            writer.writerow({table["sweep"]: row["value"], **{k: row[k] for k in COLUMNS[1:]}})


def require_matplotlib() -> None:
    """Fail before any replay runs when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'hicache-async[plot]'") from None


def plot(table: dict, path: str) -> None:
    """Stacked tier shares against capacity, with the unbounded oracle as the ceiling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    x = [r["capacity_mib"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.stackplot(x, *([r[f"l{t}_ratio"] for r in rows] for t in (1, 2, 3)), alpha=0.8,
                 labels=["L1 device", "L2 host", "L3 storage"])
    ax.plot(x, [r["oracle_ratio"] for r in rows], "k--", label="unbounded cache (oracle)")
    if x[0] > 0 and x[-1] / x[0] >= 10:
        ax.set_xscale("log")
    ax.set_xlabel(f"{table['sweep']} (MiB a rank)")
    ax.set_ylabel("share of prompt tokens served from cache")
    ax.set_ylim(0, 1)
    ax.set_title(f"hit ratio against {table['sweep']}")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(table: dict, file=None) -> None:
    print(f"capacity sweep over {table['sweep']}:", file=file)
    print(f"  {table['sweep']:>14} {'MiB':>9} {'L1':>7} {'L2':>7} {'L3':>7} {'hit':>7} {'oracle':>7}", file=file)
    for r in table["rows"]:
        print(f"  {r['value']:>14} {r['capacity_mib']:>9} {r['l1_ratio']:>7.3f} {r['l2_ratio']:>7.3f} "
              f"{r['l3_ratio']:>7.3f} {r['hit_ratio']:>7.3f} {r['oracle_ratio']:>7.3f}", file=file)
