"""What an operator and a router see of a real vLLM server with the connector: our Prometheus
metrics on its `/metrics`, and our KV events as Dynamo's standalone indexer
(`python -m dynamo.indexer`) indexes them from vLLM's ZMQ stream.

One server, one run: a prompt P is pushed out of vLLM's 32-block device cache by four
others and comes back from our host tier (45 pages: five prompts); two more push the oldest
of those (F1) out of the host tier, and it comes back from L3, up to its fifth page, whose
object we corrupted.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from hicache_async.ports import free_port

from .conftest import page_files
from .servers import metric, serving

FULL = 288      # a 300-token prompt's full 32-token pages
GOOD = 4        # F1's pages read back from L3 before the corrupt one
RECOMPUTED = 9 - GOOD   # F1's pages from the corrupt one on, saved and stored again


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def _query(port: int, tokens: list[int]) -> dict:
    """The indexer's match of `tokens` on our one instance: gpu, cpu and disk tokens."""
    found = _post(port, "/query", {"token_ids": tokens, "model_name": "llama"})["instances"].get("1", {})
    return {tier: found.get(tier, 0) for tier in ("gpu", "cpu", "disk")}


@pytest.fixture(scope="module")
def run(llama, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("observed")
    rng = random.Random(3)
    prompts = {name: [rng.randrange(3, 1000) for _ in range(300)] for name in ("P", *(f"F{i}" for i in range(1, 7)))}
    zmq_port, replay_port, index_port = free_port(), free_port(), free_port()
    transfer = {"kv_connector": "HiCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"storage": "file", "storage_path": str(root / "l3"), "host_pages": 45,
                                              "l3_reads": "always"}}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zmq_port}",
              "replay_endpoint": f"tcp://*:{replay_port}"}
    args = ["--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(events)]
    out: dict = {"queries": {}}
    with open(root / "indexer.log", "wb") as index_log:
        indexer = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(index_port)],
                                   stdout=index_log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with serving(llama, args, root / "server.log") as server:
                # ZMQ drops what is published before a subscriber joins: the replay endpoint fills the gap
                _post(index_port, "/register", {
                    "instance_id": 1, "endpoint": f"tcp://127.0.0.1:{zmq_port}", "model_name": "llama",
                    "block_size": 32, "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})

                def complete(name: str) -> dict:
                    return server.complete(prompts[name])["kv_transfer_params"]["hicache"]

                def settled_query(name: str) -> dict:
                    time.sleep(1.0)     # events go out with the next engine step, then over ZMQ
                    return _query(index_port, prompts[name])

                complete("P")
                for name in ("F1", "F2", "F3", "F4"):
                    complete(name)
                out["queries"]["P out of the device"] = settled_query("P")
                out["P from host"] = complete("P")
                complete("F5")
                complete("F6")
                out["queries"]["F1 out of the host"] = settled_query("F1")
                (obj,) = page_files(root / "l3", prompts["F1"])[GOOD]
                data = bytearray(obj.read_bytes())
                data[len(data) // 2] ^= 0x40
                obj.write_bytes(bytes(data))
                out["F1 from L3"] = complete("F1")
                for out["steppers"] in range(1, 41):    # F1's pages stored again; stats go out with a step:
                    time.sleep(0.25)
                    server.complete(prompts["P"][:8])   # a prompt of no full page steps the engine
                    time.sleep(0.25)
                    out["metrics"] = server.metrics()
                    if _settled(out["metrics"]):
                        break
                out["page_bytes"] = sum(f.stat().st_size for f in page_files(root / "l3", prompts["P"])[0])
                out["model"] = server.model
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(indexer.pid, signal.SIGKILL)
            indexer.wait(30)
    out["indexer_log"] = (root / "indexer.log").read_text(errors="replace")
    return out


def _settled(text: str) -> bool:
    """Every backup done and reported: F1's recomputed pages counted, the queue empty."""
    return (metric(text, "vllm:hicache_pages_total", op="backed_up", engine="0") == 7 * 9 + RECOMPUTED
            and metric(text, "vllm:hicache_backup_queue_pages", engine="0") == 0)


def test_prefixes_come_back_from_the_host_tier_and_from_l3(run):
    assert run["P from host"]["host_tokens"] == FULL and run["P from host"]["l3_tokens"] == 0
    assert run["F1 from L3"]["l3_tokens"] == GOOD * 32 and run["F1 from L3"]["host_tokens"] == 0


def test_metrics_count_tokens_by_tier_pages_bytes_refusals_and_l3_call_latency(run):
    text, labels = run["metrics"], {"engine": "0", "model_name": run["model"]}
    assert metric(text, "vllm:hicache_prefix_tokens_total", tier="host", **labels) == FULL
    assert metric(text, "vllm:hicache_prefix_tokens_total", tier="l3", **labels) == GOOD * 32
    assert metric(text, "vllm:hicache_pages_total", op="saved", **labels) == 7 * 9 + RECOMPUTED
    assert metric(text, "vllm:hicache_pages_total", op="backed_up", **labels) == 7 * 9 + RECOMPUTED
    assert metric(text, "vllm:hicache_pages_total", op="loaded", **labels) == 9 + GOOD
    assert metric(text, "vllm:hicache_pages_total", op="read", **labels) == GOOD
    assert metric(text, "vllm:hicache_l3_rejected_objects_total", reason="corrupt", **labels) == 1
    assert metric(text, "vllm:hicache_l3_healed_objects_total", **labels) == 1     # F1's page, stored again
    for reason in ("forged", "missing"):
        assert metric(text, "vllm:hicache_l3_rejected_objects_total", reason=reason, **labels) == 0
    assert metric(text, "vllm:hicache_l3_failed_calls_total", **labels) == 0
    # every page one object of the same size; written: 7 prompts' pages and F1's healed one (the
    # rest of F1's recomputed pages were still stored: skipped); read: F1's good pages
    assert metric(text, "vllm:hicache_l3_bytes_total", direction="write", **labels) == (7 * 9 + 1) * run["page_bytes"]
    assert metric(text, "vllm:hicache_l3_bytes_total", direction="read", **labels) == GOOD * run["page_bytes"]
    # reads: each of the 7 prompts' first look into L3 (it ends at the first object, missing) and
    # F1's prefetch; writes: a backup a prompt and F1's again
    for op, calls in (("read", 7 + 1), ("write", 7 + 1)):
        assert metric(text, "vllm:hicache_l3_call_seconds_count", op=op, **labels) == calls
        assert metric(text, "vllm:hicache_l3_call_seconds_bucket", op=op, le="+Inf", **labels) == calls
        assert 0 < metric(text, "vllm:hicache_l3_call_seconds_sum", op=op, **labels) < calls * 2.0
    assert metric(text, "vllm:hicache_backup_queue_pages", **labels) == 0        # all stored, reported


def test_first_tokens_are_timed_by_the_tier_that_served_most_of_the_prompt(run):
    """P's comeback is the one host hit; every other prompt was mostly computed (F1 took 4 of
    its 9 pages from L3), the stepping prompts too, up to the last ones, whose stats may not be
    out yet. And the cost model's estimates are exported."""
    text, labels = run["metrics"], {"engine": "0", "model_name": run["model"]}
    name = "vllm:hicache_time_to_first_token_seconds"
    assert [metric(text, f"{name}_count", tier=t, **labels) for t in ("device", "host", "l3")] == [0, 1, 0]
    assert 8 <= metric(text, f"{name}_count", tier="none", **labels) <= 8 + run["steppers"]
    assert 0 < metric(text, f"{name}_sum", tier="host", **labels) < 30
    for estimate in ("l3_read_latency_seconds", "l3_read_seconds_per_page", "prefill_seconds_per_token"):
        assert metric(text, f"vllm:hicache_{estimate}", **labels) > 0


def test_dynamos_indexer_sees_our_tiers_and_drops_no_event(run):
    assert "token_ids too short" not in run["indexer_log"]
    assert run["queries"]["P out of the device"] == {"gpu": 0, "cpu": FULL, "disk": FULL}
    assert run["queries"]["F1 out of the host"] == {"gpu": 0, "cpu": 0, "disk": FULL}
