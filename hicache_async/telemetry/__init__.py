"""Observability. `spans` is the API side the library calls; `sdk` and `trace_file` are the
application side that installs providers, exporters and structlog. Names load on first use,
so the library side never pulls in the SDK and its exporters."""
from importlib import import_module

_PUBLIC = {
    "CacheMetrics": "spans", "finish_transfer": "spans", "request_link": "spans", "start_transfer": "spans",
    "step_span": "spans", "tracing_enabled": "spans",
    "Telemetry": "sdk", "setup_telemetry": "sdk", "merge_trace_files": "trace_file",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_PUBLIC[name]}", __name__), name)
