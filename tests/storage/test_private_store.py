"""Private by default: the file store's directories are 0700 and its objects 0600, whatever
the umask, since stored KV tells what the prompts said."""
import os
import stat

import pytest
import torch

from hicache_async.keys import make_key_scheme, page_hashes
from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.storage.base import storage_backend
from hicache_async.storage.file import FileStorage
from hicache_async.transfer.page_store import PageStore

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4)


@pytest.fixture
def permissive_umask():
    old = os.umask(0o002)
    yield
    os.umask(old)


def _modes(root) -> dict[str, int]:
    out = {}
    for folder, _, files in os.walk(root):
        out[folder] = stat.S_IMODE(os.stat(folder).st_mode)
        out.update({os.path.join(folder, f): stat.S_IMODE(os.stat(os.path.join(folder, f)).st_mode)
                    for f in files})
    return out


def test_directories_are_0700_and_objects_0600(tmp_path, permissive_umask):
    root = tmp_path / "a" / "b" / "kv"
    host = HostPool(LAYOUT, 4)
    host.tensor.copy_(torch.randn(host.tensor.shape))
    store = PageStore(FileStorage(str(root)), LAYOUT, make_key_scheme("unified", LAYOUT))
    assert store.backup(page_hashes(range(16), 4), host, [0, 1, 2, 3]).ok == [True] * 4
    modes = _modes(tmp_path / "a")
    objects = [p for p in modes if os.path.isfile(p)]
    assert len(objects) == 4 * len(store.keys.objects(page_hashes(range(4), 4)[0]))
    assert {modes[p] for p in objects} == {0o600}
    assert {mode for p, mode in modes.items() if p not in objects} == {0o700}   # parents included


def test_the_default_directory_is_private_and_a_shared_one_is_left_as_it_is(tmp_path, monkeypatch,
                                                                            permissive_umask):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with storage_backend("file").open_session({"storage_path": None}) as options:
        made = _modes(tmp_path / "xdg")
    assert options["path"] in made and set(made.values()) == {0o700}
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o775)
    with storage_backend("file").open_session({"storage_path": str(shared)}):
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o775
