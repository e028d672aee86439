"""Logs: one structlog pipeline for our loggers and dependencies, tagged with rank and span."""
from __future__ import annotations

import json
import logging
import os

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider

from hicache_async.errors import UsageError
from hicache_async.telemetry.sdk import setup_telemetry
from hicache_async.topology import RankCoords

COORDS = RankCoords.of(5, 2, 2, 2)  # tp1 cp0 pp1 -> rank 5 of tp2 x cp2 x pp2
RANK_FIELDS = {"rank": 5, "tp_rank": 1, "pp_rank": 1, "cp_rank": 0}


@pytest.fixture(autouse=True)
def fresh_logging(monkeypatch, restore_logging):
    """No OTLP env; the root logger and structlog are given back afterwards."""
    for var in [v for v in os.environ if v.startswith("OTEL_")]:
        monkeypatch.delenv(var)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_line_inside_a_span_carries_its_ids_and_the_rank(capsys):
    setup_telemetry(coords=COORDS, run_id="r9", log_json=True)
    tracer = TracerProvider().get_tracer("test")  # a real span, without a global provider
    with tracer.start_as_current_span("hicache.step") as span:
        structlog.get_logger("hicache_async.hicache.cache").info("evicted", pages=4)
    structlog.get_logger("hicache_async.hicache.cache").info("idle")
    inside, outside = json_lines(capsys.readouterr().err)
    ctx = span.get_span_context()
    assert inside["event"] == "evicted" and inside["pages"] == 4 and inside["level"] == "info"
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert inside.items() >= {**RANK_FIELDS, "run_id": "r9", "logger": "hicache_async.hicache.cache"}.items()
    assert "trace_id" not in outside and outside.items() >= RANK_FIELDS.items()


def test_stdlib_records_of_dependencies_go_through_structlog(capsys):
    setup_telemetry(coords=COORDS, log_json=True)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("hicache.pp_sync") as span:
        logging.getLogger("torch.distributed").warning("store %s is slow", "tcp")
    try:
        raise OSError("disk gone")
    except OSError:
        logging.getLogger("urllib3.connectionpool").exception("export failed")
    dep, failed = json_lines(capsys.readouterr().err)
    assert dep["event"] == "store tcp is slow" and dep["logger"] == "torch.distributed"
    assert dep["level"] == "warning" and dep.items() >= RANK_FIELDS.items()
    assert dep["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert failed["level"] == "error" and failed["exception"][0]["exc_value"] == "disk gone"


def test_console_mode_is_for_people_and_level_filters(capsys):
    setup_telemetry(coords=COORDS, log_level="warning")
    structlog.get_logger("hicache_async.hicache.plugin").info("hidden")
    structlog.get_logger("hicache_async.hicache.plugin").warning("slow step", step=3)
    err = capsys.readouterr().err
    assert "hidden" not in err
    (line,) = err.splitlines()
    assert "slow step" in line and "step=3" in line and "tp_rank=1" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_setting_up_twice_keeps_one_pipeline(capsys):
    setup_telemetry(log_json=True)
    setup_telemetry(coords=COORDS, log_json=True)
    logging.getLogger("opentelemetry.sdk").error("once")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["rank"] == 5


def test_unknown_log_level_is_a_usage_error():
    with pytest.raises(UsageError, match="'LOUD'"):
        setup_telemetry(log_level="LOUD")
