"""Fixtures shared by several test modules."""
import logging

import pytest
import structlog

from tests.helpers.otlp_receiver import OTLPReceiver


@pytest.fixture
def restore_logging():
    """Give back the root logger and structlog as they were: telemetry set-up configures both."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


@pytest.fixture
def otlp_receiver():
    """A real OTLP/HTTP receiver on a free loopback port."""
    with OTLPReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    """A real mooncake_master and its segment holder on free loopback ports. (The backend is
    imported here, not above, so tests without it run where it is not on the path.)"""
    from hicache_mooncake import MooncakeMaster

    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    with MooncakeMaster(holder_bytes=256 << 20, log_path=str(log)) as master:
        yield master


@pytest.fixture
def mooncake_storage(mooncake_master):
    """An adapter connected to `mooncake_master` that mounts no segment of its own: objects land
    in the holder's, as in a deployment."""
    from hicache_mooncake import MooncakeStorage

    adapter = MooncakeStorage(master=mooncake_master.address, metadata_url=mooncake_master.metadata_url,
                              buffer_bytes=16 << 20)
    yield adapter
    adapter.close()
