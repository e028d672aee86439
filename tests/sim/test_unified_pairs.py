"""Topology-free keys, both ways: KV that one topology wrote under `--key-scheme unified` is read
back by another, including readers that need only part of a writer's objects (TP1 -> TP2, PP2,
CP2) and readers that need several writers' objects (TP2 -> TP1, PP2 -> PP1). Each reader starts
with empty L1/L2, gets L3 hits, and matches the reference in tokens and in every cached page."""
import shutil

from hicache_async.config import CacheConfig
from hicache_async.engine.tiny.model import ModelConfig
from hicache_async.engine.tiny.workload import WorkloadSpec
from hicache_async.sim.jobs.simulate_rank import payload_of
from hicache_async.sim.ranks.launcher import launch
from tests.helpers.reference_kv import assert_like_reference, reference

SPEC = WorkloadSpec(requests=12, turns=3, system_prompts=2, system_len=32, user_len=(8, 16),
                    max_new=4, concurrency=4)
CACHE = CacheConfig(device_pages=24, host_pages=48, page_size=8, prefetch_threshold=8, key_scheme="unified",
                    sync_timeout_s=60)
OUTPUTS, KV = reference(ModelConfig(), SPEC, CACHE.page_size)
GRID = {"tp1": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2)}


def _run(topology: str, runs: dict[str, str]) -> dict[str, list[dict]]:
    """One launch on `topology`, one run per storage directory; each run's reports by name."""
    payloads = {}
    for name, path in runs.items():
        payloads[name] = payload_of(ModelConfig(), CACHE, SPEC, {"name": "file", "options": {"path": path}})
        payloads[name]["kv_reference"] = KV
    tp, pp, cp = GRID[topology]
    results = launch(tp=tp, pp=pp, cp=cp, target="tests.helpers.sim_targets:matrix", payload={"runs": payloads},
                     timeout_s=60)
    return {name: [r[name] for r in results] for name in runs}


def _copy(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_kv_written_by_one_topology_is_read_by_another(tmp_path):
    written = {}
    written["tp1"] = _run("tp1", {"w": str(tmp_path / "tp1")})["w"]
    reads = {}
    for reader in ("tp2", "pp2", "cp2"):
        runs = {"r": _copy(tmp_path / "tp1", tmp_path / f"tp1-to-{reader}")}
        if reader in ("tp2", "pp2"):
            runs["w"] = str(tmp_path / reader)
        out = _run(reader, runs)
        reads[f"tp1->{reader}"] = out["r"]
        if "w" in out:
            written[reader] = out["w"]
    reads.update({f"{w}->tp1": r for w, r in _run("tp1", {
        "tp2": _copy(tmp_path / "tp2", tmp_path / "tp2-to-tp1"),
        "pp2": _copy(tmp_path / "pp2", tmp_path / "pp2-to-tp1")}).items()})
    for name, reports in written.items():
        assert_like_reference(reports, OUTPUTS, f"writer {name}")
        assert sum(r["l3_bytes_written"] for r in reports) > 0, name
    for name, reports in reads.items():
        first = assert_like_reference(reports, OUTPUTS, name)
        assert first["tokens_from_l3"] > 0, (name, first)
        assert sum(r["corrupt_objects"] + r["storage_errors"] for r in reports) == 0, name
