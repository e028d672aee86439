"""One benchmark figure beside the baseline it is compared with, measured in the same run."""
from __future__ import annotations

import time
from collections.abc import Callable


def figure(name: str, value: float, unit: str, baseline_name: str, baseline: float) -> dict:
    return {"name": name, "value": round(value, 3), "unit": unit, "baseline_name": baseline_name,
            "baseline_value": round(baseline, 3), "ratio": round(value / baseline, 3) if baseline else None}


def skipped(name: str, unit: str, baseline_name: str, reason: str) -> dict:
    return {"name": name, "value": None, "unit": unit, "baseline_name": baseline_name,
            "baseline_value": None, "ratio": None, "skipped": reason}


def gbps(nbytes: int, run: Callable[[], object]) -> float:
    """Throughput of one call of `run` moving `nbytes`, in GB/s."""
    start = time.perf_counter()
    run()
    return nbytes / (time.perf_counter() - start) / 1e9
