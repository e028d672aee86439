"""A sweep's plot: hit ratio and TTFT p90 against the swept value, beside no cache and the ideal cache.

Ticks sit at the swept values and read as a person writes them ("128 GiB", "2 GB/s"); a
capacity axis also names its tokens, since GiB alone depends on the model.
"""
from __future__ import annotations

import os

from ...errors import UsageError
from . import units

TIERS = (("l1_ratio", "L1 device"), ("l2_ratio", "L2 host"), ("l3_ratio", "L3 storage"))


def require_matplotlib() -> None:
    """Fail before any replay runs when --plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'hicache-async[plot]'") from None


def _is_capacity(table: dict) -> bool:
    return table["unit"] in ("pages", "bytes") and table["sweep"] != "kv-bytes-per-token"


def _x(table: dict) -> tuple[list[float], list[str], str]:
    """x values, their tick labels and the axis label: a capacity in the modelled model's KV
    bytes, any other knob as swept."""
    rows = table["rows"]
    if _is_capacity(table):
        x = [r["capacity_tokens"] * r["kv_bytes_per_token"] for r in rows]
        return x, [units.size(v) for v in x], f"{table['label']}, KV of the modelled model"
    if table["unit"] == "bytes":
        return [r["value"] for r in rows], [units.size(r["value"]) for r in rows], table["label"]
    return [r["value"] for r in rows], [units.number(r["value"]) for r in rows], f"{table['label']} ({table['unit']})"


def _ms_scale(values: list[float]) -> tuple[float, str]:
    return (1000.0, "s") if max(values) >= 10_000 else (1.0, "ms")


def plot(table: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig = draw(table)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw(table: dict):
    """The sweep's figure: hit ratio by tier over TTFT p90, sharing the swept axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    rows = table["rows"]
    x, labels, xlabel = _x(table)
    fig, (hit, ttft) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 7))
    hit.stackplot(x, *([r[key] for r in rows] for key, _ in TIERS), alpha=0.75,
                  labels=[name for _, name in TIERS], colors=("#4c72b0", "#55a868", "#dd8452"))
    hit.plot(x, [r["hit_ratio"] for r in rows], "o", color="#333333", ms=4, label="hit ratio (each run)")
    hit.plot(x, [r["oracle_ratio"] for r in rows], "k--", label="ideal cache (unbounded)")
    hit.axhline(0, color="#c44e52", lw=2, label="no cache")
    hit.set_ylim(0, 1)
    hit.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    hit.set_ylabel("prompt tokens served from cache")
    hit.legend(loc="upper left", fontsize="small", ncols=2)

    _ttft_panel(ttft, x, rows)
    if len(x) > 1 and min(x) > 0 and max(x) / min(x) >= 10:
        ttft.set_xscale("log")
    _fixed_ticks(ttft.xaxis, x, labels)
    if _is_capacity(table):
        per_token = rows[0]["kv_bytes_per_token"]
        tokens = hit.secondary_xaxis("top", functions=(lambda b: b / per_token, lambda t: t * per_token))
        _fixed_ticks(tokens.xaxis, [r["capacity_tokens"] for r in rows],
                     [units.count(r["capacity_tokens"]) for r in rows])
        tokens.set_xlabel(f"{table['capacity_of']} capacity in tokens")
    ttft.set_xlabel(xlabel)
    for ax in (hit, ttft):
        ax.grid(alpha=0.3)
    title = f"{os.path.basename(table['trace'])}: hit ratio and TTFT p90 against the {table['label']}"
    hit.set_title("\n".join(filter(None, (title, _fixed_part(table)))), fontsize="medium")
    fig.tight_layout()
    return fig


def _ttft_panel(ax, x: list[float], rows: list[dict]) -> None:
    """TTFT p90 of each run beside the same trace with no cache and with the ideal cache; on a
    log axis when they span more than a decade, so seconds near the ideal stay apart."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    series = {key: [r[key] for r in rows] for key in ("ttft_ms_p90", "baseline_ttft_ms_p90", "oracle_ttft_ms_p90")}
    scale, unit = _ms_scale([v for values in series.values() for v in values])
    ax.plot(x, [v / scale for v in series["ttft_ms_p90"]], "o-", color="#4c72b0", label="this configuration")
    ax.plot(x, [v / scale for v in series["baseline_ttft_ms_p90"]], "-", color="#c44e52", label="no cache")
    ax.plot(x, [v / scale for v in series["oracle_ttft_ms_p90"]], "k--", label="ideal cache")
    low, high = min(min(v) for v in series.values()), max(max(v) for v in series.values())
    if low > 0 and high / low > 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: units.number(v)))
    ax.set_ylabel(f"TTFT p90 ({unit})")
    ax.legend(loc="best", fontsize="small")


def _fixed_ticks(axis, at: list[float], labels: list[str]) -> None:
    """Ticks at the swept values only, labelled as given: no offsets, no 10^n minor labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    axis.set_major_locator(FixedLocator(at))
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(lambda v, pos: labels[pos] if pos is not None and pos < len(labels) else ""))


def _fixed_part(table: dict) -> str:
    """What the sweep held still: the model and, for a hardware sweep, the host pool."""
    first = table["rows"][0]
    held = [f"modelled {table['model']}"]
    if table["sweep"] == "kv-bytes-per-token":
        held.append(f"{table['capacity_of']} {units.tokens(first['capacity_tokens'])}")
    elif not _is_capacity(table):
        held.append(f"{table['capacity_of']} {units.size(first['capacity_tokens'] * first['kv_bytes_per_token'])} "
                    f"({units.tokens(first['capacity_tokens'])})")
    return ", ".join(held)
