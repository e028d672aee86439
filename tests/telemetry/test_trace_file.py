"""`--trace-file` output is OTLP JSON that protobuf parses back, per rank and merged."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from hicache_async.errors import HiCacheError
from hicache_async.telemetry.spans import step_context
from hicache_async.telemetry.trace_file import OTLPJsonFileExporter, merge_trace_files, part_path, read_part

RANK = r"""
import json, sys
from hicache_async.telemetry.sdk import setup_telemetry
from hicache_async.telemetry.spans import finish_transfer, request_link, start_transfer, step_span
from hicache_async.topology import RankCoords

coords = RankCoords.of(int(sys.argv[1]), 2, 1, 1)
tel = setup_telemetry(coords=coords, run_id="run-F", trace_file=sys.argv[2])
with step_span("run-F", 1, coords) as step:
    load = start_transfer("load", pages=2, nbytes=64, coords=coords,
                          links=[request_link("run-F", 3)])
    finish_transfer(load)
tel.shutdown()
print(json.dumps({"hicache.step": format(step.get_span_context().span_id, "016x"),
                  "hicache.transfer.load": format(load.get_span_context().span_id, "016x")}))
"""


def write_part(rank: int, path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", RANK, str(rank), str(path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def hex_to_b64(doc: dict) -> dict:
    """OTLP/JSON ids are hex; protobuf's JSON mapping of bytes is base64."""
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for obj in (span, *span.get("links", ())):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in obj:
                            assert obj[key] == obj[key].lower() and len(obj[key]) in (16, 32)
                            obj[key] = base64.b64encode(bytes.fromhex(obj[key])).decode()
    return doc


def load(path) -> TracesData:
    """A merged trace file, or a rank's part file (one document per line)."""
    if str(path).endswith(".part"):
        return ParseDict(hex_to_b64({"resourceSpans": read_part(str(path))}), TracesData())
    with open(path, encoding="utf-8") as f:
        return ParseDict(hex_to_b64(json.load(f)), TracesData())


def spans_of(data: TracesData) -> list[tuple[dict, object]]:
    out = []
    for rs in data.resource_spans:
        resource = {kv.key: kv.value for kv in rs.resource.attributes}
        out += [(resource, span) for ss in rs.scope_spans for span in ss.spans]
    return out


@pytest.fixture
def parts(tmp_path):
    paths = [part_path(str(tmp_path / "trace.json"), r) for r in (0, 1)]
    emitted = [write_part(r, p) for r, p in enumerate(paths)]
    return tmp_path, paths, emitted


def test_part_file_parses_as_otlp_and_ids_round_trip(parts):
    _, paths, emitted = parts
    for path, ids in zip(paths, emitted):
        spans = spans_of(load(path))
        assert {span.name: span.span_id.hex() for _, span in spans} == ids
        resource, _ = spans[0]
        assert resource["service.name"].string_value == "hicache-async"
        step = next(s for _, s in spans if s.name == "hicache.step")
        transfer = next(s for _, s in spans if s.name == "hicache.transfer.load")
        assert transfer.parent_span_id == step.span_id
        assert step.parent_span_id.hex() == format(step_context("run-F", 1).span_id, "016x")
        assert transfer.kind == 1 and len(transfer.links) == 1


def test_merged_file_keeps_every_rank_and_removes_the_parts(parts):
    folder, paths, emitted = parts
    merged = folder / "trace.json"
    assert merge_trace_files([str(p) for p in paths] + [str(folder / "missing.part")], str(merged)) == 4
    spans = spans_of(load(merged))
    steps = {int(res["parallel.rank"].int_value): s for res, s in spans if s.name == "hicache.step"}
    assert {r: s.span_id.hex() for r, s in steps.items()} == {
        r: e["hicache.step"] for r, e in enumerate(emitted)}
    assert steps[0].trace_id == steps[1].trace_id
    assert sorted(os.listdir(folder)) == ["trace.json"]


def test_merge_names_a_malformed_part(tmp_path):
    bad = tmp_path / "rank1.part"
    bad.write_text('{"data": []}\n')
    with pytest.raises(HiCacheError, match="rank1.part line 1"):
        merge_trace_files([str(bad)], str(tmp_path / "out.json"))
    assert not (tmp_path / "out.json").exists()


def test_each_batch_is_appended_whole_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "trace.json.rank0.part"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPJsonFileExporter(str(path))))
    tracer = provider.get_tracer("test")
    assert spans_of(load(path)) == []
    for n in (1, 2):
        with tracer.start_as_current_span(f"batch{n}"):
            pass
        assert [s.name for _, s in spans_of(load(path))] == [f"batch{i}" for i in range(1, n + 1)]
        assert path.read_text().count("\n") == n      # one line a batch: appended, never rewritten
    provider.shutdown()
    with open(path, "a") as f:
        f.write('{"resourceSpans": [{"scopeSp')   # a rank killed mid-write
    assert [s.name for _, s in spans_of(load(path))] == ["batch1", "batch2"]


def test_example_writes_a_transfer_linked_to_two_requests(tmp_path):
    path = tmp_path / "example.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "examples/traced_transfer.py", "--trace-file", str(path)],
                          cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    spans = {s.name: s for _, s in spans_of(load(path))}
    write = spans["hicache.transfer.write"]
    assert write.parent_span_id == spans["hicache.step"].span_id and len(write.links) == 2
    attrs = {kv.key: kv.value for kv in write.attributes}
    assert attrs["hicache.pages"].int_value == 4 and attrs["hicache.tier.dst"].string_value == "l2"
