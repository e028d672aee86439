"""Fixtures shared by several test modules."""
import logging

import pytest
import structlog


@pytest.fixture
def restore_logging():
    """Give back the root logger and structlog as they were: telemetry set-up configures both."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()
