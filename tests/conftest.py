"""Fixtures shared by several test modules, and the count of processes the suite starts."""
import logging
import os
from unittest import mock

import pytest
import structlog

from hicache_vllm.bench import launch
from tests.helpers import starts
from tests.helpers.otlp_receiver import OTLPReceiver


ENGINE_TESTS = ("tests/plugins/vllm/",)


def pytest_collection_modifyitems(items):
    """The modules that start vLLM engines and servers first, each in its own order: under
    xdist they are the longest units, so they are handed out before the short ones that even
    out the end."""
    items.sort(key=lambda item: not item.nodeid.startswith(ENGINE_TESTS))


def pytest_runtest_setup(item):
    """Past the engine modules (they come first), a worker's pooled engines are killed: idle,
    they still take CPU from the tests beside them. (A later engine test would start its own.)"""
    if not item.nodeid.startswith(ENGINE_TESTS):
        from tests.plugins.vllm.engines import POOLS

        for pool in POOLS:
            pool.close()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under xdist (scripts/test.sh) each module is a unit of work, handed out in collection
    order to the first idle worker; its module fixtures start once, and each worker pools
    its own engines (`tests/plugins/vllm/engines.py`)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::")[0]

    config.option.loadscopereorder = False
    return ByModule(config, log)


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


@pytest.fixture(scope="session", autouse=True)
def warm_starts(tmp_path_factory):
    """vLLM engines and servers start as forks of one process that has imported vLLM
    (`launch.warm`): seconds a start, not ten; the fork server starts with the first of them."""
    server = launch.warm(("hicache_vllm.bench.engine", "vllm.entrypoints.openai.api_server"),
                         ("vllm", "vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server"),
                         {**os.environ, "HF_HUB_OFFLINE": "1"}, tmp_path_factory.getbasetemp() / "forkserver.log")
    yield server
    server.close()


@pytest.fixture(autouse=True)
def restore_environment():
    """Each test leaves the process's environment as it found it, whoever wrote to it. vLLM's
    CPU platform, building a config in-process, puts its libgomp in LD_PRELOAD: every later
    subprocess of that worker then loaded libgomp before it could choose OpenMP's wait policy."""
    with mock.patch.dict(os.environ):
        yield


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
