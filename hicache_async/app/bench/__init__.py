"""`hicache-async bench`: every figure beside a baseline measured in the same run. The core's
groups are here; each engine's comes from its own package, found by entry point
(`extensions.BENCH_GROUPS`)."""
from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

from ...errors import EngineMissing, UsageError
from ..extensions import BENCH_GROUPS, installed
from .figure import skipped


def _suite(quick: bool) -> dict[str, Callable[[], list[dict]]]:
    from . import admission
    from . import core_figures as core
    from . import sync_figures as sync
    from .gpu_copy_figures import gpu_copy_figures
    from .storage_figures import storage_figures

    n = 1 if quick else 4
    return {
        "on_step_idle_us": lambda: [core.on_step_idle(2_000 * n)],
        "l1_l2_copy_gbps": lambda: core.l1_l2_copy(pages=16, reps=n, rounds=20 * n),
        "on_step_tp2pp2_us": lambda: [sync.on_step_tp2pp2(blocks=20 * n, steps=25)],
        "admission_scale": lambda: [admission.admission_scale(admissions=200 * n, rounds=3 if quick else 5)],
        "storage": lambda: storage_figures(quick=quick),
        "gpu-copies": lambda: gpu_copy_figures(quick=quick),
        **{name: lambda ep=ep: ep.load()(quick=quick) for name, ep in installed(BENCH_GROUPS).items()},
        # Last: it installs a global tracer provider.
        "tracing_overhead_pct": lambda: [core.tracing_overhead(pages=16, reps=2 * n, rounds=3 + 2 * n)],
    }


def run_bench(quick: bool = False, only: list[str] | None = None) -> list[dict]:
    """The figures of every group, or of `only` these; a group whose engine is missing is one
    skipped entry, or the error when it was asked for by name."""
    suite = _suite(quick)
    unknown = sorted(set(only or ()) - set(suite))
    if unknown:
        raise UsageError(f"unknown figure {unknown[0]!r}: expected one of {', '.join(suite)}")
    names = [n for n in suite if not only or n in only]
    figures: list[dict] = []
    for name in tqdm(names, desc="bench", unit="group", disable=None):
        try:
            figures += suite[name]()
        except EngineMissing as exc:
            if only:
                raise
            figures.append(skipped(name, "", "", str(exc)))
    return figures
