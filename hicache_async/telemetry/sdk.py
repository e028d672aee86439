"""Application-side telemetry: installs the OpenTelemetry SDK and configures structlog.

Only the CLI and examples import this; the library uses the API (`hicache_async.telemetry.spans`)
and `structlog.get_logger(__name__)`. Exporters follow the standard `OTEL_*` variables;
with no endpoint and no trace file no SDK is installed and tracing stays a no-op.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import structlog
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from ..errors import UsageError
from ..topology import RankCoords
from .trace_file import OTLPJsonFileExporter

PROTOCOLS = ("http/protobuf", "grpc")


@dataclass
class Telemetry:
    """What `setup_telemetry` installed. Shut down at exit, or earlier by `shutdown()`."""

    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    _done: bool = field(default=False, repr=False)

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        """Flush and stop both providers at once; give up after `timeout_s` (collector down).

        Returns False when the deadline passed with telemetry still unsent. Idempotent.
        """
        if self._done:
            return True
        self._done = True
        atexit.unregister(self.shutdown)
        closers = []
        if self.tracer_provider is not None:
            closers.append(self._close_traces)
        if self.meter_provider is not None:
            closers.append(lambda: self.meter_provider.shutdown(timeout_millis=timeout_s * 1000))
        workers = [threading.Thread(target=c, name="telemetry-shutdown", daemon=True) for c in closers]
        deadline = time.monotonic() + timeout_s
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        if any(w.is_alive() for w in workers):
            structlog.get_logger(__name__).warning("telemetry not flushed: exporter still busy",
                                                   timeout_s=timeout_s)
            return False
        return True

    def _close_traces(self) -> None:
        self.tracer_provider.force_flush()
        self.tracer_provider.shutdown()


def _env(*names: str) -> tuple[str, str] | None:
    """The first of `names` set to a non-empty value, with that value."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _protocol(signal: str) -> str:
    found = _env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    if found is None:
        return "http/protobuf"
    name, value = found
    if value not in PROTOCOLS:
        raise UsageError(f"unsupported OTLP protocol {value!r} in {name}: use http/protobuf or grpc")
    return value


_OTLP = "opentelemetry.exporter.otlp.proto"
_EXPORTERS = {
    ("traces", "http/protobuf"): (f"{_OTLP}.http.trace_exporter", "OTLPSpanExporter"),
    ("traces", "grpc"): (f"{_OTLP}.grpc.trace_exporter", "OTLPSpanExporter"),
    ("metrics", "http/protobuf"): (f"{_OTLP}.http.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "grpc"): (f"{_OTLP}.grpc.metric_exporter", "OTLPMetricExporter"),
}


def _otlp_exporter(signal: str):
    """The OTLP exporter for `signal` ("traces" or "metrics"); it reads its endpoint from env."""
    protocol = _protocol(signal)
    module, cls = _EXPORTERS[signal, protocol]
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError:
        package = module.rsplit(".", 1)[0].replace(".", "-")
        raise UsageError(f"OTLP protocol {protocol!r} needs {package} "
                         "(pip install 'hicache-async[otlp]')") from None


def _resource(service_name: str, coords: RankCoords | None, run_id: str | None) -> Resource:
    attrs: dict[str, object] = {"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name}
    if coords is not None:
        attrs.update(coords.attributes())
    if run_id is not None:
        attrs["hicache.run_id"] = run_id
    return Resource.create(attrs)


def setup_telemetry(*, service_name: str = "hicache-async", coords: RankCoords | None = None,
                    run_id: str | None = None, trace_file: str | None = None, log_json: bool = False,
                    log_level: str = "INFO", logs: bool = True) -> Telemetry:
    """Configure logs (unless the host process owns them: `logs=False`, as inside an engine),
    then install tracer and meter providers if anything will read them."""
    if logs:
        configure_logging(coords=coords, run_id=run_id, json_lines=log_json, level=log_level)
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    trace_endpoint = _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    metric_endpoint = _env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    span_exporters = []
    metric_exporter = None
    if not disabled:
        if trace_endpoint:
            span_exporters.append(_otlp_exporter("traces"))
        if metric_endpoint:
            metric_exporter = _otlp_exporter("metrics")
        if trace_file:
            span_exporters.append(OTLPJsonFileExporter(trace_file))

    telemetry = Telemetry()
    resource = _resource(service_name, coords, run_id)
    if span_exporters:
        telemetry.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        for exporter in span_exporters:
            telemetry.tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(telemetry.tracer_provider)
    if metric_exporter:
        reader = PeriodicExportingMetricReader(metric_exporter)
        telemetry.meter_provider = MeterProvider(resource=resource, metric_readers=[reader],
                                                 shutdown_on_exit=False)
        metrics.set_meter_provider(telemetry.meter_provider)
    if telemetry.tracer_provider or telemetry.meter_provider:
        atexit.register(telemetry.shutdown)
    return telemetry


def _rank_fields(coords: RankCoords, run_id: str | None):
    fields: dict[str, object] = {"rank": coords.rank, "tp_rank": coords.tp_rank,
                                 "pp_rank": coords.pp_rank, "cp_rank": coords.cp_rank}
    if run_id is not None:
        fields["run_id"] = run_id

    def add_rank(_logger, _method, event: dict) -> dict:
        for key, value in fields.items():
            event.setdefault(key, value)
        return event
    return add_rank


def add_trace_ids(_logger, _method, event: dict) -> dict:
    """`trace_id` and `span_id` of the current span, in the hex Jaeger shows."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


DEPENDENCIES = ("torch", "urllib3", "opentelemetry", "mooncake", "asyncio")


def _route_dependencies() -> None:
    """Dependencies that installed their own stderr handlers (torch does, once its logging
    initialises) would bypass the pipeline: send their records up to the root handler."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.split(".")[0] in DEPENDENCIES:
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True


def configure_logging(*, coords: RankCoords | None = None, run_id: str | None = None,
                      json_lines: bool = False, level: str = "INFO") -> None:
    """One stderr pipeline for structlog and stdlib `logging`; repeat calls replace it."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise UsageError(f"unknown log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _rank_fields(coords or RankCoords(), run_id),
        add_trace_ids,
    ]
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.PositionalArgumentsFormatter(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    if json_lines:
        render = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        render = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name("hicache-async")
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render]))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "hicache-async"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    _route_dependencies()
