"""SGLang tests run where sglang 0.5.23 is installed (`--no-deps`, plugins/sglang/requirements-cpu.txt)."""
import pytest

from tests.plugins.sglang import cpu_stubs

cpu_stubs.install()
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")

from tests.plugins.sglang.harness import published, tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A tiny model checkpoint folder, the model every test's server serves."""
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(autouse=True)
def server_args(checkpoint):
    """SGLang's server args, published as its scheduler process publishes them before it builds a cache."""
    with published(model_path=str(checkpoint)):
        yield


@pytest.fixture
def dynamic(tmp_path):
    """The `dynamic` extra config that loads our class, over a fresh file store."""
    return {"backend_name": "hicache-async", "module_path": "hicache_sglang", "class_name": "HiCacheAsyncStorage",
            "interface_v1": 1, "storage_path": str(tmp_path / "l3")}
