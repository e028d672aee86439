"""Observability. `spans` is the API side the library calls; `sdk` and `trace_file` are the
application side that installs providers, exporters and structlog.
"""
