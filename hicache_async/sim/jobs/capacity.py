"""Planning sweeps: one replay per value of a capacity or a hardware figure, and what each buys.

The answer a user wants is "with this much host memory (or this L3 bandwidth) this traffic gets
Y% of the reuse it could get, and TTFT Z beside no cache and the ideal cache": each row puts the
tiers' shares and TTFT beside the unbounded oracle of the same trace. Capacities are counted in
the modelled model's tokens and KV bytes, never in the replay's stand-in bytes.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from ...config import CacheConfig
from ...engine.replay.model import ReplayModelSpec
from ...engine.replay.workload import ReplaySpec
from ...errors import UsageError
from ...storage.base import storage_backend
from . import units
from .harness import RunArgs
from .replay import run

TTFT_FIELDS = (*(f"{who}ttft_ms_p{q}" for who in ("", "baseline_", "oracle_") for q in (50, 90, 99)),
               "ttft_p90_reduction_captured")
CHECK_FIELDS = ("kv_verified_pages", "kv_mismatches", "seconds")


def parse_size(text: str) -> int:
    """Bytes from `123`, `64K`, `512M`, `2G` (binary multiples); a usage error otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise UsageError(f"expected a positive size like 4096, 512M or 2G, got {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def _pages(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise ValueError(text)
    return int(value) if value.is_integer() else value


_EXPECTS = {_pages: "a positive integer", _positive: "a positive number", parse_size: "a positive size like 512M"}


@dataclass(frozen=True)
class Knob:
    """A flag a sweep can vary: where its value goes, how its text reads, how an axis names it."""

    where: str                       # "cache", "args" (the run) or "hardware" (the modelled machine)
    field: str
    parse: Callable[[str], float]
    label: str
    unit: str                        # "pages", "bytes" or a unit printed beside the number
    tier: str | None = None          # the tier whose capacity it sets

    def configure(self, args: RunArgs, cache: CacheConfig, spec: ReplaySpec, value):
        """(args, cache, spec) of the run at `value`."""
        if self.where == "cache":
            return args, dataclasses.replace(cache, **{self.field: value}), spec
        if self.where == "args":
            return dataclasses.replace(args, **{self.field: value}), cache, spec
        return args, cache, with_hardware(spec, **{self.field: value})


KNOBS = {
    "device-pages": Knob("cache", "device_pages", _pages, "device pool (L1)", "pages", "L1 device"),
    "host-pages": Knob("cache", "host_pages", _pages, "host pool (L2)", "pages", "L2 host"),
    "l3-capacity": Knob("args", "l3_capacity", parse_size, "L3 capacity", "bytes", "L3 storage"),
    "pcie-gbps": Knob("hardware", "pcie_gbps", _positive, "L1-L2 (PCIe) bandwidth", "GB/s"),
    "l3-read-gbps": Knob("hardware", "l3_read_gbps", _positive, "L3 read bandwidth", "GB/s"),
    "l3-write-gbps": Knob("hardware", "l3_write_gbps", _positive, "L3 write bandwidth", "GB/s"),
    "l3-latency-us": Knob("hardware", "l3_latency_us", _positive, "L3 latency a call", "µs"),
    "kv-bytes-per-token": Knob("hardware", "kv_bytes_per_token", parse_size, "KV a token", "bytes"),
}


def with_hardware(spec: ReplaySpec, **values) -> ReplaySpec:
    """The replay spec with these hardware-model fields changed."""
    return dataclasses.replace(spec, hardware=dataclasses.replace(spec.hardware, **values))


def parse_sweep(text: str, storage: str) -> tuple[str, list]:
    """`NAME=A,B,C` -> (NAME, sorted distinct values); a usage error naming the bad part otherwise."""
    name, sep, values = text.partition("=")
    if not sep:
        raise UsageError(f"--sweep {text!r}: expected NAME=A,B,C")
    if name not in KNOBS:
        raise UsageError(f"--sweep {text!r}: unknown name {name!r}; expected one of {', '.join(KNOBS)}")
    if name == "l3-capacity" and (storage == "none" or not storage_backend(storage).takes_capacity):
        raise UsageError(f"--sweep {name}: the {storage} storage has no capacity to sweep")
    knob, parsed = KNOBS[name], []
    for part in values.split(","):
        try:
            parsed.append(knob.parse(part.strip()))
        except (ValueError, UsageError):
            raise UsageError(f"--sweep {text!r}: {part!r} is not {_EXPECTS[knob.parse]}") from None
    return name, sorted(set(parsed))


def sweep(args: RunArgs, cache: CacheConfig, spec: ReplaySpec, name: str, values: list,
          model: ReplayModelSpec = ReplayModelSpec(), on_run=lambda result: None) -> dict:
    """Replay once per value (each from a cold L3 unless --storage-path names one)."""
    knob, runs = KNOBS[name], []
    for value in values:
        result = run(*knob.configure(args, cache, spec, value), model)
        on_run(result)
        runs.append(result)
    stand_in = _stand_in_page_bytes(model, cache.page_size)
    return {"sweep": name, "label": knob.label, "unit": knob.unit, "capacity_of": knob.tier or "L2 host",
            "trace": spec.trace, "model": runs[0]["model"],
            "rows": [_row(knob, v, r, stand_in) for v, r in zip(values, runs)], "runs": runs}


def _stand_in_page_bytes(model: ReplayModelSpec, page_size: int) -> int:
    """Bytes the replay engine stores for one page over all ranks: float16 K and V of every layer and head."""
    return model.layers * 2 * model.kv_heads * model.head_dim * page_size * 2


def _row(knob: Knob, value, result: dict, stand_in_page_bytes: int) -> dict:
    page_size = result["page_size"]
    if knob.tier is None:                 # a hardware sweep: the host pool it ran with
        pages = result["host_pages"]
    elif knob.field == "l3_capacity":
        pages = value // stand_in_page_bytes
    else:
        pages = value
    tokens, per_token = pages * page_size, result["kv_bytes_per_token"]
    hits = {f"{tier}_ratio": result["tiers"][tier]["share"] for tier in ("l1", "l2", "l3")}
    return {"value": value, "kv_bytes_per_token": per_token, "capacity_tokens": tokens,
            "capacity_gib": round(tokens * per_token / 2**30, 3), **hits,
            **{k: result[k] for k in ("hit_ratio", "oracle_ratio", "oracle_captured")},
            **{k: result[k] for k in (*TTFT_FIELDS, *CHECK_FIELDS)}}


def write_csv(table: dict, path: str) -> None:
    columns = list(table["rows"][0])
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[table["sweep"], *columns[1:]])
        writer.writeheader()
        for row in table["rows"]:
            writer.writerow({table["sweep"]: row["value"], **{k: row[k] for k in columns[1:]}})


def value_text(table: dict, value) -> str:
    """A swept value as a person writes it: "16 GiB", "4096 pages", "2.5 GB/s"."""
    unit = table["unit"]
    if unit == "bytes":
        return units.size(value)
    return f"{value} pages" if unit == "pages" else f"{units.number(value)} {unit}"


def print_table(table: dict, file=None) -> None:
    print(f"sweep over {table['sweep']}, the {table['label']}: capacity of {table['capacity_of']} in the "
          f"modelled model's tokens and KV; TTFT p90 in ms beside no cache and the ideal cache", file=file)
    print(f"  {table['sweep']:>18} {'tokens':>13} {'KV':>9} {'L1':>6} {'L2':>6} {'L3':>6} {'hit':>6} {'ideal':>6} "
          f"{'TTFT p90':>9} {'no cache':>9} {'ideal':>9}", file=file)
    for r in table["rows"]:
        cells = [f"{value_text(table, r['value']):>18}", f"{units.tokens(r['capacity_tokens']):>13}",
                 f"{units.size(r['capacity_tokens'] * r['kv_bytes_per_token']):>9}",
                 *(f"{r[k]:>6.3f}" for k in ("l1_ratio", "l2_ratio", "l3_ratio", "hit_ratio", "oracle_ratio")),
                 *(f"{r[k]:>9,.0f}" for k in ("ttft_ms_p90", "baseline_ttft_ms_p90", "oracle_ttft_ms_p90"))]
        print("  " + " ".join(cells), file=file)
