"""Spans and metrics reach a real OTLP/HTTP receiver from separate rank processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hicache_async.errors import UsageError
from hicache_async.ports import free_port
from hicache_async.telemetry.sdk import _otlp_exporter, setup_telemetry
from hicache_async.telemetry.spans import request_context, step_context

RUN = "run-A"

# One simulated rank: a step with transfers, a request span, a storage call and metrics.
RANK = r"""
import json, sys, threading
from hicache_async.errors import StorageError
from hicache_async.telemetry.sdk import setup_telemetry
from hicache_async.telemetry.spans import (CacheMetrics, begin_step, finish_transfer, pp_sync_span,
                                     request_link, request_span, start_transfer, step_span,
                                     storage_span, tracing_enabled)
from hicache_async.topology import RankCoords

coords = RankCoords.of(int(sys.argv[1]), 2, 1, 1)
tel = setup_telemetry(coords=coords, run_id="run-A")
metrics = CacheMetrics()
with step_span("run-A", 7, coords) as step:
    with pp_sync_span(coords) as sync:
        sync.set_attribute("hicache.agreed_ops", 2)
    with request_span("run-A", 11, coords):
        pass
    backup = start_transfer("backup", pages=3, nbytes=3 * 4096, coords=coords,
                            key_scheme="unified",
                            links=[request_link("run-A", 11), request_link("run-A", 12)])
    finish_transfer(backup)
    worker = threading.Thread(target=lambda: finish_transfer(start_transfer(
        "write", pages=1, nbytes=4096, coords=coords, parent=step)))
    worker.start()
    worker.join(10)
    load = start_transfer("load", pages=2, nbytes=8192, coords=coords)
    finish_transfer(load, error=StorageError("page 3 unreadable"))
    try:
        with storage_span("batch_get", keys=3, coords=coords, backend="file"):
            raise StorageError("disk gone")
    except StorageError:
        pass
    metrics.tokens("l3", 48)
    metrics.transfer("backup", 3 * 4096, 0.01)
    metrics.queue_depth("write", 2)
# The plugin's way: the step span stays open across awaits without being current.
step8 = begin_step("run-A", 8, coords)
with pp_sync_span(coords, parent=step8):
    pass
with request_span("run-A", 12, coords, step=step8):
    pass
step8.end()
ctx = step.get_span_context()
tel.shutdown()
print(json.dumps({"enabled": tracing_enabled(), "step_span_id": format(ctx.span_id, "016x")}))
"""


def run_ranks(env: dict[str, str], ranks=(0, 1), timeout: float = 60) -> list[dict]:
    """Start one process per rank at once; return what each printed."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r)], env={**base, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in ranks]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def by_rank(spans, **attrs) -> dict:
    """Spans keyed by the rank that sent them, keeping those whose attributes include `attrs`."""
    picked = {s.resource["parallel.rank"]: s for s in spans if s.attributes.items() >= attrs.items()}
    assert len(picked) == len([s for s in spans if s.attributes.items() >= attrs.items()])
    return picked


def test_two_ranks_share_the_step_trace_over_otlp_http(otlp_receiver):
    outs = run_ranks({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_SERVICE_NAME": "sim"})
    assert all(o["enabled"] for o in outs)
    otlp_receiver.wait_for(lambda r: len(r.spans_named("hicache.step")) == 4, timeout=10)

    steps = by_rank(otlp_receiver.spans_named("hicache.step"), **{"hicache.step": 7})
    shared = step_context(RUN, 7)
    assert set(steps) == {0, 1}
    for rank, step in steps.items():
        assert step.trace_id == format(shared.trace_id, "032x")
        assert step.parent_span_id == format(shared.span_id, "016x")
        assert step.span_id == outs[rank]["step_span_id"]
        assert step.attributes["hicache.step"] == 7 and step.attributes["parallel.tp_rank"] == rank
        assert step.resource["service.name"] == "sim"
        assert step.resource["hicache.run_id"] == RUN
        assert step.resource["parallel.tp_size"] == 2

    backups = by_rank(otlp_receiver.spans_named("hicache.transfer.backup"))
    for rank, span in backups.items():
        assert span.parent_span_id == steps[rank].span_id
        assert span.trace_id == steps[rank].trace_id
        assert span.attributes == {
            "hicache.transfer.kind": "backup", "hicache.tier.src": "l2", "hicache.tier.dst": "l3",
            "hicache.pages": 3, "hicache.bytes": 12288, "hicache.key_scheme": "unified",
            "hicache.result": "ok", **{k: v for k, v in steps[rank].attributes.items()
                                       if k.startswith("parallel.")}}
        linked = {(ln.trace_id, ln.span_id) for ln in span.links}
        for request in (11, 12):
            ctx = request_context(RUN, request)
            assert (format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")) in linked

    for rank, span in by_rank(otlp_receiver.spans_named("hicache.transfer.write")).items():
        assert span.parent_span_id == steps[rank].span_id, "worker-thread transfer lost its step"

    for span in otlp_receiver.spans_named("hicache.transfer.load"):
        assert span.status_code == 2 and "page 3 unreadable" in span.status_message
        assert span.attributes["hicache.result"] == "error" and "exception" in span.events

    for span in otlp_receiver.spans_named("hicache.storage.batch_get"):
        assert span.status_code == 2 and "exception" in span.events
        assert span.attributes["hicache.storage.keys"] == 3

    agreed = {"hicache.agreed_ops": 2}
    for rank, span in by_rank(otlp_receiver.spans_named("hicache.pp_sync"), **agreed).items():
        assert span.parent_span_id == steps[rank].span_id

    later = by_rank(otlp_receiver.spans_named("hicache.step"), **{"hicache.step": 8})
    assert len({s.trace_id for s in later.values()}) == 1
    assert later[0].trace_id == format(step_context(RUN, 8).trace_id, "032x")
    syncs = {s.parent_span_id for s in otlp_receiver.spans_named("hicache.pp_sync")}
    assert {s.span_id for s in later.values()} <= syncs

    for request_id, step in ((11, steps), (12, later)):
        request = request_context(RUN, request_id)
        spans = [s for s in otlp_receiver.spans_named("hicache.request")
                 if s.attributes["hicache.request_id"] == request_id]
        for rank, span in by_rank(spans).items():
            assert span.trace_id == format(request.trace_id, "032x")
            assert [ln.span_id for ln in span.links] == [step[rank].span_id]

    otlp_receiver.wait_for(lambda r: {m.name for m in r.metrics} >= {"hicache.tokens.served"}, timeout=10)
    tokens = [m for m in otlp_receiver.metrics if m.name == "hicache.tokens.served"]
    assert sorted(m.resource["parallel.rank"] for m in tokens) == [0, 1]
    assert all(m.points == [({"hicache.tier": "l3"}, 48)] for m in tokens)
    names = {m.name for m in otlp_receiver.metrics}
    assert {"hicache.transfer.bytes", "hicache.transfer.duration", "hicache.queue.depth"} <= names


def test_without_endpoint_nothing_is_installed_or_sent(otlp_receiver):
    outs = run_ranks({}, ranks=(0,))
    assert outs == [{"enabled": False, "step_span_id": "0" * 16}]


def test_sdk_disabled_sends_nothing(otlp_receiver):
    outs = run_ranks({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_SDK_DISABLED": "true"},
                     ranks=(0,))
    assert outs[0]["enabled"] is False
    assert otlp_receiver.requests == 0


def test_sampler_from_env_is_honoured(otlp_receiver):
    run_ranks({"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint, "OTEL_TRACES_SAMPLER": "always_off"},
              ranks=(0,))
    otlp_receiver.wait_for(lambda r: r.metrics, timeout=10)  # the process did export
    assert otlp_receiver.spans == []


def test_shutdown_is_bounded_when_the_collector_is_down():
    port = free_port()
    start = time.monotonic()
    run_ranks({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, ranks=(0,), timeout=90)
    assert time.monotonic() - start < 12


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])
def test_unsupported_protocol_is_a_usage_error_naming_it(monkeypatch, var):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(var, "http/json")
    with pytest.raises(UsageError, match=f"'http/json' in {var}"):
        setup_telemetry()


def test_grpc_protocol_selects_the_grpc_exporter(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    exporter = _otlp_exporter("traces")
    try:
        assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    finally:
        exporter.shutdown()
