"""Spans and metrics the cache emits, through the OpenTelemetry API only.

The library never installs an SDK: without one every call here is a cheap no-op. The
application (CLI, examples) installs it with `hicache_async.telemetry.sdk.setup_telemetry`.

Cross-rank joining: the parent of every rank's `hicache.step` span for step N is the same
*remote* span context, derived from sha256(run_id, step). So all ranks' spans of one step
land in one trace without exchanging a message. Requests get a derived context the same
way, so a transfer on any rank can link to every request it serves.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import (
    INVALID_SPAN,
    Link,
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
)

from ..kinds import TransferKind
from ..topology import RankCoords

SCOPE = "hicache_async"
STEP = "hicache.step"
PP_SYNC = "hicache.pp_sync"
REQUEST = "hicache.request"
STORAGE_OPS = ("batch_exists", "batch_get", "batch_set", "batch_remove")
TIERS = ("l1", "l2", "l3", "computed")

_tracer = trace.get_tracer(SCOPE)
_seen: tuple[object, bool] = (None, False)  # (provider last checked, whether it records)


def tracing_enabled() -> bool:
    """False until the application installs a real tracer provider; the no-op fast path."""
    global _seen
    provider = trace.get_tracer_provider()
    if provider is not _seen[0]:
        _seen = (provider, not isinstance(provider, (ProxyTracerProvider, NoOpTracerProvider)))
    return _seen[1]


def derived_context(*parts: object) -> SpanContext:
    """A sampled remote span context that every process derives identically from `parts`."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def step_context(run_id: str, step: int) -> SpanContext:
    """The shared parent of every rank's `hicache.step` span for this step."""
    return derived_context(run_id, "step", step)


def request_context(run_id: str, request_id: int) -> SpanContext:
    """The shared parent of a request's spans; the target of transfer links."""
    return derived_context(run_id, "request", request_id)


def request_link(run_id: str, request_id: int) -> Link:
    return Link(request_context(run_id, request_id), {"hicache.request_id": request_id})


def _under(parent: SpanContext) -> otel_context.Context:
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _in(parent: Span | None) -> otel_context.Context | None:
    """Context under `parent`, or None for the current one. Worker threads and async code that
    keeps the step span open across awaits pass the parent explicitly."""
    if parent is None or not parent.get_span_context().is_valid:
        return None
    return trace.set_span_in_context(parent)


def begin_step(run_id: str, step: int, coords: RankCoords) -> Span:
    """Start (not as current) `hicache.step`, covering one whole scheduler iteration.

    The caller ends it when the next step begins, so transfers issued during admission and
    after the forward pass nest under the step they were issued in. Without an SDK this is
    `INVALID_SPAN`, whose `end()` does nothing.
    """
    if not tracing_enabled():
        return INVALID_SPAN
    span = _tracer.start_span(STEP, context=_under(step_context(run_id, step)))
    if span.is_recording():
        span.set_attributes({"hicache.run_id": run_id, "hicache.step": step, **coords.attributes()})
    return span


@contextmanager
def step_span(run_id: str, step: int, coords: RankCoords) -> Iterator[Span]:
    """`hicache.step` as the current span, in the trace every rank shares for this step."""
    span = begin_step(run_id, step, coords)
    if span is INVALID_SPAN:
        yield span
        return
    with trace.use_span(span, end_on_exit=True):
        yield span


@contextmanager
def request_span(run_id: str, request_id: int, coords: RankCoords, *, step: Span | None = None,
                 attrs: Mapping[str, object] | None = None) -> Iterator[Span]:
    """`hicache.request` (e.g. admission) in the request's own trace, linked to `step`
    (default: the current span)."""
    if not tracing_enabled():
        yield INVALID_SPAN
        return
    current = (step or trace.get_current_span()).get_span_context()
    links = [Link(current)] if current.is_valid else None
    with _tracer.start_as_current_span(REQUEST, context=_under(request_context(run_id, request_id)),
                                       links=links) as span:
        if span.is_recording():
            span.set_attributes({"hicache.run_id": run_id, "hicache.request_id": request_id,
                                 **coords.attributes(), **(attrs or {})})
        yield span


@contextmanager
def pp_sync_span(coords: RankCoords, *, parent: Span | None = None) -> Iterator[Span]:
    """`hicache.pp_sync`: the per-step agreement; set the agreed counts on the yielded span."""
    if not tracing_enabled():
        yield INVALID_SPAN
        return
    with _tracer.start_as_current_span(PP_SYNC, context=_in(parent)) as span:
        if span.is_recording():
            span.set_attributes(coords.attributes())
        yield span


def start_transfer(kind: TransferKind | str, *, pages: int, nbytes: int, coords: RankCoords,
                   key_scheme: str | None = None, links: list[Link] | None = None,
                   attrs: Mapping[str, object] | None = None, parent: Span | None = None) -> Span:
    """Start (not as current) `hicache.transfer.<kind>` under `parent` or the current span."""
    try:
        kind = TransferKind(kind)
    except ValueError:
        raise ValueError(f"unknown transfer kind {kind!r}: expected one of "
                         f"{', '.join(k.value for k in TransferKind)}") from None
    src, dst = kind.route
    if not tracing_enabled():
        return INVALID_SPAN
    span = _tracer.start_span(f"hicache.transfer.{kind}", context=_in(parent), links=links)
    if span.is_recording():
        span.set_attributes({"hicache.transfer.kind": kind.value, "hicache.tier.src": src,
                             "hicache.tier.dst": dst, "hicache.pages": pages, "hicache.bytes": nbytes,
                             **coords.attributes(), **(attrs or {})})
        if key_scheme is not None:
            span.set_attribute("hicache.key_scheme", key_scheme)
    return span


def finish_transfer(span: Span, *, result: str = "ok", error: BaseException | None = None,
                    attrs: Mapping[str, object] | None = None) -> None:
    """Record the outcome and end the span; safe from any thread."""
    if span.is_recording():
        span.set_attribute("hicache.result", "error" if error is not None and result == "ok" else result)
        if attrs:
            span.set_attributes(dict(attrs))
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


@contextmanager
def storage_span(op: str, *, keys: int, coords: RankCoords, backend: str,
                 parent: Span | None = None) -> Iterator[Span]:
    """`hicache.storage.<op>` around one storage batch call; exceptions are recorded and re-raised."""
    if op not in STORAGE_OPS:
        raise ValueError(f"unknown storage op {op!r}: expected one of {', '.join(STORAGE_OPS)}")
    if not tracing_enabled():
        yield INVALID_SPAN
        return
    with _tracer.start_as_current_span(f"hicache.storage.{op}", context=_in(parent)) as span:
        if span.is_recording():
            span.set_attributes({"hicache.storage.backend": backend, "hicache.storage.keys": keys,
                                 **coords.attributes()})
        yield span


class CacheMetrics:
    """Counters and histograms of the cache; no-ops until an SDK meter provider is installed."""

    def __init__(self) -> None:
        meter = metrics.get_meter(SCOPE)
        self._tokens = meter.create_counter(
            "hicache.tokens.served", unit="{token}", description="Prompt tokens by the tier that served them")
        self._bytes = meter.create_counter(
            "hicache.transfer.bytes", unit="By", description="Bytes moved between tiers")
        self._duration = meter.create_histogram(
            "hicache.transfer.duration", unit="s", description="Time from issue to retirement of a transfer")
        self._storage_errors = meter.create_counter(
            "hicache.storage.errors", unit="{error}", description="Failed storage batch calls")
        self._bad_objects = meter.create_counter(
            "hicache.storage.bad_objects", unit="{object}",
            description="Stored objects read back corrupt or missing (each a miss, never used)")
        self._queue_depth = meter.create_gauge(
            "hicache.queue.depth", unit="{op}", description="Ops waiting in a transfer queue")

    def tokens(self, tier: str, n: int) -> None:
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
        self._tokens.add(n, {"hicache.tier": tier})

    def transfer(self, kind: str, nbytes: int, seconds: float) -> None:
        attrs = {"hicache.transfer.kind": kind}
        self._bytes.add(nbytes, attrs)
        self._duration.record(seconds, attrs)

    def storage_error(self, backend: str, op: str) -> None:
        self._storage_errors.add(1, {"hicache.storage.backend": backend, "hicache.storage.op": op})

    def bad_objects(self, reason: str, n: int) -> None:
        self._bad_objects.add(n, {"hicache.storage.reason": reason})

    def queue_depth(self, kind: str, depth: int) -> None:
        self._queue_depth.set(depth, {"hicache.transfer.kind": kind})

