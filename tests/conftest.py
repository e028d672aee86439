"""Fixtures shared by several test modules, and the count of processes the suite starts."""
import logging

import pytest
import structlog

from tests.helpers import starts
from tests.helpers.otlp_receiver import OTLPReceiver


ENGINE_TESTS = ("tests/plugins/vllm/", "tests/app/test_vllm_")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under xdist (scripts/test.sh): the tests that start vLLM engines are one scope, run in
    their order on one worker, so each pooled engine starts once and one engine runs at a time;
    every other module is a scope of its own (its module fixtures start once), run on the other
    worker beside them. (xdist's `loadgroup` marks do not reach its scheduler under pytest 9.)"""
    from xdist.scheduler import LoadScopeScheduling

    class EngineTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::")[0]
            return "vllm-engines" if path.startswith(ENGINE_TESTS) else path

    return EngineTestsTogether(config, log)


def pytest_sessionfinish(session):
    """An xdist worker hands its count of process starts to the controller."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["process_starts"] = dict(starts.STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    starts.STARTS.update(getattr(node, "workeroutput", {}).get("process_starts", {}))


def pytest_terminal_summary(terminalreporter):
    if starts.STARTS:
        terminalreporter.write_line(starts.summary(starts.STARTS))


@pytest.fixture(scope="session", autouse=True)
def count_process_starts():
    """From the first test on, every subprocess a test starts."""
    starts.count_subprocesses()


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
