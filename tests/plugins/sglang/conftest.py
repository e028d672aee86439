"""SGLang tests run where sglang 0.5.23 is installed (`--no-deps`, plugins/sglang/requirements-cpu.txt)."""
import pytest

from tests.plugins.sglang import cpu_stubs

cpu_stubs.install()
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed")


@pytest.fixture
def dynamic(tmp_path):
    """The `dynamic` extra config that loads our class, over a fresh file store."""
    return {"backend_name": "hicache-async", "module_path": "hicache_sglang", "class_name": "HiCacheAsyncStorage",
            "interface_v1": 1, "storage_path": str(tmp_path / "l3")}
