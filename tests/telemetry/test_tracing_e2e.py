"""Real OTLP/HTTP on loopback from a real tp=2 x pp=2 simulate with the L3 tier."""
import base64
import json
import os
import subprocess
import sys
from collections import defaultdict

from google.protobuf import json_format
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

KINDS = ("write", "load", "backup", "prefetch")
RANK_ATTRS = ("parallel.tp_rank", "parallel.tp_size", "parallel.pp_rank", "parallel.pp_size",
              "parallel.cp_rank", "parallel.cp_size")


def test_every_transfer_kind_from_every_rank_joined_per_step(otlp_receiver, tmp_path):
    trace_file = tmp_path / "trace.json"
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
           "OTEL_SERVICE_NAME": "hicache-e2e"}
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_async", "simulate", "--tp", "2", "--pp", "2",
         "--requests", "12", "--page-size", "8", "--device-pages", "60", "--host-pages", "80",
         "--prefetch-threshold", "8", "--storage", "file", "--storage-path", str(tmp_path / "kv"),
         "--trace-file", str(trace_file), "--json", str(tmp_path / "run.json")],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["outputs_match_reference"] and run["tokens_from_l2"] > 0

    spans = otlp_receiver.spans
    by_kind = defaultdict(set)
    for s in spans:
        if s.name.startswith("hicache.transfer."):
            kind = s.attributes["hicache.transfer.kind"]
            by_kind[kind].add(s.attributes["parallel.rank"])
            for attr in ("hicache.tier.src", "hicache.tier.dst", "hicache.pages", "hicache.bytes",
                         "hicache.result", *RANK_ATTRS):
                assert attr in s.attributes, (s.name, attr)
            if kind in ("backup", "prefetch"):
                assert s.attributes["hicache.key_scheme"] == "rank-suffix"
    for kind in KINDS:
        assert by_kind[kind] == {0, 1, 2, 3}, (kind, by_kind[kind])
    assert all(s.resource["service.name"] == "hicache-e2e" for s in spans)

    # One step's spans from all ranks share one trace, under the step span of each rank.
    steps = defaultdict(list)
    for s in spans:
        if s.name == "hicache.step":
            steps[s.attributes["hicache.step"]].append(s)
    joined = [n for n, group in steps.items()
              if {s.attributes["parallel.rank"] for s in group} == {0, 1, 2, 3}]
    assert joined, "no step traced on every rank"
    step = steps[joined[0]]
    assert len({s.trace_id for s in step}) == 1
    step_ids = {s.span_id for s in step}
    syncs = [s for s in spans if s.name == "hicache.pp_sync" and s.parent_span_id in step_ids]
    assert {s.attributes["parallel.rank"] for s in syncs} == {0, 1, 2, 3}
    assert all(s.trace_id == step[0].trace_id for s in syncs)

    # Storage batch calls nest under the transfer that made them.
    transfers = {s.span_id: s for s in spans if s.name.startswith("hicache.transfer.")}
    storage = [s for s in spans if s.name.startswith("hicache.storage.")]
    assert storage and all(transfers[s.parent_span_id].name in ("hicache.transfer.backup",
                                                                "hicache.transfer.prefetch")
                           for s in storage)
    # Loads and prefetches link to the requests they serve.
    assert any(s.links for s in transfers.values() if s.name == "hicache.transfer.load")

    # The trace file is valid OTLP JSON (hex ids) holding every rank's spans.
    doc = json.loads(trace_file.read_text())
    ids = set()
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                ids.add(span["spanId"])
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
                for link in span.get("links", []):
                    for key in ("traceId", "spanId"):
                        link[key] = base64.b64encode(bytes.fromhex(link[key])).decode()
    parsed = json_format.Parse(json.dumps(doc), TracesData())
    ranks = {kv.value.int_value for rs in parsed.resource_spans for kv in rs.resource.attributes
             if kv.key == "parallel.rank"}
    assert ranks == {0, 1, 2, 3}
    assert {s.span_id for s in transfers.values()} <= ids
