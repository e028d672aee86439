"""Spans as one OTLP/JSON document on disk, for viewing traces without a collector.

The file is `{"resourceSpans": [...]}` in the protobuf JSON mapping with trace and span ids
as lowercase hex (what the OTLP/JSON spec requires and Jaeger's UI uploads). Each rank
process writes its own part file; the launcher merges the parts into one.
"""
from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
from collections.abc import Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ..errors import HiCacheError

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex(b64: str) -> str:
    return base64.b64decode(b64).hex()


def _hex_ids(span: dict) -> dict:
    for obj in (span, *span.get("links", ())):
        for field in _ID_FIELDS:
            if field in obj:
                obj[field] = _hex(obj[field])
    return span


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> list[dict]:
    """The `resourceSpans` entries for `spans`, ids in hex, enums as integers."""
    doc = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    entries = doc.get("resourceSpans", [])
    for entry in entries:
        for scope in entry.get("scopeSpans", ()):
            scope["spans"] = [_hex_ids(s) for s in scope.get("spans", ())]
    return entries


def write_json_atomic(path: str, doc: dict) -> None:
    """Write beside `path`, then rename, so readers never see half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class OTLPJsonFileExporter(SpanExporter):
    """Appends each batch as one line: an OTLP/JSON document (the collector's file format).

    Appending costs the batch, not the file so far; a rank that dies mid-write leaves every
    earlier line whole, and the merge skips a torn last line.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._closed = False
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path, "w").close()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps({"resourceSpans": spans_to_otlp_json(spans)}, separators=(",", ":")) + "\n"
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def part_path(path: str, rank: int) -> str:
    """Where rank `rank` writes its part of the trace file `path` until the launcher merges."""
    return f"{path}.rank{rank}.part"


def read_part(part: str) -> list[dict]:
    """The `resourceSpans` entries of a part file; a torn last line is skipped."""
    with open(part, encoding="utf-8") as f:
        lines = f.read().split("\n")
    entries: list[dict] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as e:
            if number == len(lines):   # no newline after it: the writer died mid-line
                break
            raise HiCacheError(f"trace part {part} line {number} is not JSON: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
            raise HiCacheError(f"trace part {part} line {number} is not OTLP JSON: no resourceSpans list")
        entries.extend(doc["resourceSpans"])
    return entries


def merge_trace_files(parts: list[str], path: str) -> int:
    """Merge per-rank part files into one document at `path`, then remove the parts; returns
    the span count. A missing part (a rank that died before its first export) is skipped."""
    entries: list[dict] = []
    found = []
    for part in parts:
        try:
            entries.extend(read_part(part))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise HiCacheError(f"cannot read trace part {part}: {e}") from None
        found.append(part)
    write_json_atomic(path, {"resourceSpans": entries})
    for part in found:
        os.unlink(part)
    return sum(len(s.get("spans", ())) for e in entries for s in e.get("scopeSpans", ()))
