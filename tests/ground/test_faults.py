"""Injected faults must be caught: wrong KV fails the run with a line naming the mismatch, and
a failed copy fails it quickly with a line naming the rank, the op and the cause."""
import json
import os
import subprocess
import sys
import time

import pytest

# Small pools and a low prefetch threshold: this workload is served from L1, L2 and L3.
RUN = ["simulate", "--storage", "memory", "--requests", "24", "--host-pages", "16", "--device-pages", "32",
       "--prefetch-threshold", "16", "--timeout", "20"]


def _simulate(fault: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_ASYNC_FAULT"}
    if fault:
        env["HICACHE_ASYNC_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "hicache_async", *RUN, *extra], env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_unfaulted_run_is_served_by_every_tier_and_verified(tmp_path):
    done = _simulate(None, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert min(out["tokens_from_l1"], out["tokens_from_l2"], out["tokens_from_l3"]) > 0, out
    assert out["kv_mismatches"] == 0 and out["kv_verified_pages"] > 0


# A load fault hits whatever an L2 -> L1 load serves: pages from L2, and pages prefetched from
# L3 (they reach L1 through the same load); which one the run meets first is a matter of timing.
@pytest.mark.parametrize("fault,tiers", [("swap-load-pages", ("l2", "l3")), ("noise-load", ("l2", "l3")),
                                         ("corrupt-stored", ("l3",))])
def test_wrong_kv_fails_the_run_naming_the_mismatch(fault, tiers, tmp_path):
    done = _simulate(fault, "--json", str(tmp_path / "out.json"))
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert "KV mismatch in request" in error and any(f"served from {t} " in error for t in tiers), error
    assert json.loads((tmp_path / "out.json").read_text())["kv_mismatches"] > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_a_failed_copy_fails_fast_naming_rank_op_and_cause(tp):
    start = time.monotonic()
    done = _simulate("copy-error", "--tp", str(tp))
    assert time.monotonic() - start < 20 + 30        # within --timeout, plus process start-up
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert "rank " in error and "write op of" in error and "injected fault" in error, error


def test_an_unknown_fault_is_a_usage_error():
    done = _simulate("gremlins")
    assert done.returncode == 2 and "gremlins" in done.stderr and "Traceback" not in done.stderr
