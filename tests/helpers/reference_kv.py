"""The cache-less reference for tests: its tokens, and its KV recorded where ranks can read it."""
import hashlib
import os
import tempfile

from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.sim.jobs.reference import reference_run

_DIR = tempfile.TemporaryDirectory(prefix="hicache-test-kv-")   # lives as long as the test process


def reference(model: ModelConfig, spec: WorkloadSpec, page_size: int) -> tuple[dict, str]:
    """(outputs, path of the recorded KV) for a `kv_reference` payload entry."""
    outputs, recorder = reference_run(model, spec, page_size)
    tag = hashlib.sha256(repr((spec, page_size)).encode()).hexdigest()[:12]
    path = os.path.join(_DIR.name, f"{model.model_id}-{tag}")
    recorder.save(path)
    return outputs, path


def assert_like_reference(reports: list[dict], outputs: dict, name: str = "") -> dict:
    """The ranks of one run made the same cache decisions, generated the reference's tokens and
    found the reference's KV in every cached page; returns the first rank's report."""
    first = reports[0]
    assert all(r["digest"] == first["digest"] for r in reports), name
    assert first["outputs"] == outputs, name
    assert_kv_verified(reports, name)
    return first


def assert_kv_verified(reports: list[dict], name: str = "") -> None:
    """Every rank checked cached pages against the reference, and none differed."""
    assert sum(r["kv_mismatches"] for r in reports) == 0, (name, [r["kv_first_mismatch"] for r in reports])
    assert all(r["kv_verified_pages"] > 0 for r in reports), (name, [r["kv_verified_pages"] for r in reports])
