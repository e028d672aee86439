"""A real OTLP/HTTP receiver on loopback, so tests see exactly what an exporter sent."""
from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


def any_value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return getattr(v, kind)


def attributes(kvs: list[KeyValue]) -> dict[str, object]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class LinkRecord:
    trace_id: str
    span_id: str
    attributes: dict


@dataclass(frozen=True)
class SpanRecord:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str   # "" for a root span
    attributes: dict
    resource: dict
    links: list[LinkRecord]
    status_code: int      # 0 unset, 1 ok, 2 error
    status_message: str
    events: list[str]


@dataclass(frozen=True)
class MetricRecord:
    name: str
    resource: dict
    points: list[tuple[dict, object]]  # (attributes, value: number or histogram count)


def _metric_points(metric) -> list[tuple[dict, object]]:
    kind = metric.WhichOneof("data")
    data = getattr(metric, kind)
    if kind == "histogram":
        return [(attributes(p.attributes), p.count) for p in data.data_points]
    return [(attributes(p.attributes), getattr(p, p.WhichOneof("value"))) for p in data.data_points]


@dataclass
class OTLPReceiver:
    """Accepts POST /v1/traces, /v1/metrics and /v1/logs (protobuf, optionally gzip/deflate)."""

    spans: list[SpanRecord] = field(default_factory=list)
    metrics: list[MetricRecord] = field(default_factory=list)
    log_records: int = 0
    requests: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver",
                                        daemon=True)

    @property
    def endpoint(self) -> str:
        """Base URL for `OTEL_EXPORTER_OTLP_ENDPOINT`."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "OTLPReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "OTLPReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_for(self, predicate: Callable[["OTLPReceiver"], bool], timeout: float = 10.0) -> None:
        """Poll `predicate(self)` until true; raise TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if predicate(self):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"OTLP receiver: condition not met within {timeout}s "
                                   f"({len(self.spans)} spans, {len(self.metrics)} metrics received)")
            time.sleep(0.02)

    def spans_named(self, name: str) -> list[SpanRecord]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def _ingest(self, path: str, body: bytes) -> bytes | None:
        if path == "/v1/traces":
            req = ExportTraceServiceRequest.FromString(body)
            records = [_span_record(s, attributes(rs.resource.attributes))
                       for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
            with self._lock:
                self.requests += 1
                self.spans.extend(records)
            return ExportTraceServiceResponse().SerializeToString()
        if path == "/v1/metrics":
            req = ExportMetricsServiceRequest.FromString(body)
            records = [MetricRecord(m.name, attributes(rm.resource.attributes), _metric_points(m))
                       for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
            with self._lock:
                self.requests += 1
                self.metrics.extend(records)
            return ExportMetricsServiceResponse().SerializeToString()
        if path == "/v1/logs":
            req = ExportLogsServiceRequest.FromString(body)
            n = sum(len(sl.log_records) for rl in req.resource_logs for sl in rl.scope_logs)
            with self._lock:
                self.requests += 1
                self.log_records += n
            return ExportLogsServiceResponse().SerializeToString()
        return None


def _span_record(s, resource: dict) -> SpanRecord:
    return SpanRecord(
        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
        parent_span_id=s.parent_span_id.hex(), attributes=attributes(s.attributes), resource=resource,
        links=[LinkRecord(ln.trace_id.hex(), ln.span_id.hex(), attributes(ln.attributes)) for ln in s.links],
        status_code=s.status.code, status_message=s.status.message, events=[e.name for e in s.events])


def _handler_for(receiver: OTLPReceiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server naming)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            encoding = self.headers.get("Content-Encoding", "").lower()
            try:
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                reply = receiver._ingest(self.path, body)
            except Exception as e:  # a malformed export is the client's error, reported as 400
                self._answer(400, f"bad OTLP request: {e}".encode(), "text/plain")
                return
            if reply is None:
                self._answer(404, b"unknown OTLP path", "text/plain")
            else:
                self._answer(200, reply, "application/x-protobuf")

        def _answer(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            """Quiet: tests read records, not access logs."""

    return Handler
