"""SGLang's factory builds our class from `dynamic` config and by the name our plugin registers;
a bad extra config stops SGLang's start with one line naming the bad key or value."""
import pytest
from hicache_sglang import HiCacheAsyncStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_async.errors import UsageError
from tests.plugins.sglang import harness as h


def config(extra: dict, **placement) -> HiCacheStorageConfig:
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                  enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny/model")
    return HiCacheStorageConfig(**{**fields, **placement}, extra_config=extra)


def test_dynamic_config_builds_ours(dynamic):
    backend = StorageBackendFactory.create_backend("dynamic", config(dynamic), None)
    assert isinstance(backend, HiCacheAsyncStorage)
    backend.close()


def test_the_entry_point_registers_the_name_and_the_controller_takes_v1(tmp_path):
    from sglang.srt.plugins import load_plugins

    load_plugins()      # runs every `sglang.srt.plugins` entry point, ours among them
    backend = StorageBackendFactory.create_backend("hicache-async", config({"storage_path": str(tmp_path)}), None)
    assert isinstance(backend, HiCacheAsyncStorage)
    backend.close()
    pool = h.host_pool("mha", "page_first")
    with h.controller(pool, "hicache-async", {"storage_path": str(tmp_path)}) as ctl:
        assert ctl.page_set_func == ctl._page_set_zero_copy
        slots = pool.alloc(2 * h.PAGE)
        assert h.back_up(ctl, list(range(2 * h.PAGE)), slots) == 2 * h.PAGE


@pytest.mark.parametrize("extra,named", [
    ({"storage_pth": "/tmp/x"}, "unknown key 'storage_pth'"),
    ({"key_scheme": "topological"}, "key-scheme 'topological'"),
    ({"storage_timeout": -1}, "bad storage_timeout -1"),
    ({"storage": "floppy"}, "unknown storage 'floppy'"),
    ({"storage": "mooncake", "mooncake_master": "nowhere"}, "bad mooncake_master 'nowhere'"),
    ({"storage_path": "/tmp/x", "mooncake_master": "127.0.0.1:1"}, "unknown key 'mooncake_master' (storage file)"),
    ({"head_group": 0}, "bad head_group 0"),
])
def test_bad_config_is_one_line_naming_it(dynamic, extra, named):
    loader = {k: v for k, v in dynamic.items() if k != "storage_path"}
    with pytest.raises(UsageError) as err:
        StorageBackendFactory.create_backend("dynamic", config({**loader, **extra}), None)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_a_missing_secret_file_stops_the_start(dynamic, tmp_path):
    pool = h.host_pool("mha", "page_first")
    with pytest.raises(UsageError, match="storage-secret-file") as err:
        backend = HiCacheAsyncStorage(config({**dynamic, "storage_secret_file": str(tmp_path / "none")}))
        backend.register_mem_pool_host(pool)
    assert "\n" not in str(err.value)
