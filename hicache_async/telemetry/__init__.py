"""Observability. `spans` is the API side the library calls; `sdk` and `trace_file` are the
application side that installs providers, exporters and structlog. Names load on first use (`lazy_loader`),
so the library side never pulls in the SDK and its exporters."""
import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "spans": ["CacheMetrics", "finish_transfer", "request_link", "start_transfer", "step_span", "tracing_enabled"],
    "sdk": ["Telemetry", "setup_telemetry"], "trace_file": ["merge_trace_files"],
})
