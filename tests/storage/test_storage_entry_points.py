"""`--storage` lists every backend registered in the `hicache_async.storage` entry points, and each
backend owns its setup: its own flags (in `--help`, passed to it and to no other backend) and a
per-run session in the launching process. So a backend a third party installs shows up and runs
with no change to our code."""
import json
import os
import subprocess
import sys

import pytest

from hicache_async.app.cli import main
from hicache_async.errors import StorageError
from hicache_async.storage.base import storage_backend
from tests.helpers.installed_backend import installed_backend_env

BACKEND = '''
import contextlib
import os

from hicache_async.storage.memory import MemoryStorage


class VaultStorage(MemoryStorage):
    """A third party's backend: the in-process store, with a flag and a session of its own."""

    @classmethod
    def add_options(cls, group):
        group.add_argument("--vault-log", metavar="PATH", help="note every rank that opens the vault")

    @classmethod
    @contextlib.contextmanager
    def open_session(cls, options, *, capacity_bytes=None, cold=False):
        yield {"log": options["vault_log"], "session_pid": os.getpid()}

    def __init__(self, log=None, session_pid=None, **options):
        super().__init__(**options)
        if log:
            with open(log, "a") as f:
                f.write(f"{session_pid} {os.getpid()}\\n")
'''


def _installed(tmp_path) -> dict:
    """An environment where a package `vault-backend` is installed: its module and its dist-info."""
    (tmp_path / "vault_backend.py").write_text(BACKEND)
    return {**installed_backend_env(tmp_path, "vault", "vault_backend:VaultStorage"),
            "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache_async", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_pip_installed_backend_brings_its_flag_and_session(tmp_path):
    env = _installed(tmp_path)
    help_text = _cli(env, "simulate", "--help").stdout
    assert "vault" in help_text and "mooncake" in help_text and "file" in help_text
    assert "--vault-log PATH" in help_text and "note every rank that opens the vault" in help_text
    plain = _cli({**os.environ}, "simulate", "--help").stdout
    assert "vault" not in plain and "--storage-path" in plain   # not installed: not offered
    log = tmp_path / "opened.log"
    done = _cli(env, "simulate", "--storage", "vault", "--vault-log", str(log), "--tp", "2",
                "--requests", "8", "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["storage_used"] == "vault" and out["l3_bytes_written"] > 0 and out["kv_mismatches"] == 0
    opened = [line.split() for line in log.read_text().splitlines()]
    assert len(opened) == 2, opened                         # each rank opened it with the flag's value
    session_pids, rank_pids = {s for s, _ in opened}, {r for _, r in opened}
    assert len(session_pids) == 1 and len(rank_pids) == 2    # one session, in the launching process
    assert not session_pids & rank_pids


def test_a_backend_flag_for_another_backend_is_a_usage_error(tmp_path):
    done = _cli(_installed(tmp_path), "simulate", "--storage", "memory", "--vault-log", "x.log")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--vault-log x.log needs --storage vault" in done.stderr


def test_file_session_resolves_and_cleans_up_its_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    file = storage_backend("file")
    with file.open_session({"storage_path": None}) as options:
        assert options == {"path": str(tmp_path / "xdg" / "hicache-async" / "kv")}
    with file.open_session({"storage_path": None}, capacity_bytes=1 << 20, cold=True) as options:
        scratch = options["path"]
        assert os.path.isdir(scratch) and options["capacity_bytes"] == 1 << 20
    assert not os.path.exists(scratch)                      # a cold run's scratch goes with it
    named = tmp_path / "named"
    with file.open_session({"storage_path": str(named)}, cold=True) as options:
        assert options == {"path": str(named)}
    assert named.is_dir()                                   # a named directory is the user's: kept
    (tmp_path / "plain-file").write_text("")
    with pytest.raises(StorageError, match="plain-file"):
        with file.open_session({"storage_path": str(tmp_path / "plain-file" / "kv")}):
            pass


@pytest.mark.parametrize("argv,code,named", [
    (["--storage", "memory", "--l3-capacity", "1M"], 2, "--l3-capacity 1048576: the memory storage has no capacity"),
    (["--storage-path", "/dev/null/kv"], 1, "file storage /dev/null/kv: cannot create directory"),
])
def test_a_session_that_cannot_start_is_one_line(argv, code, named, capsys):
    assert main(["simulate", "--requests", "2", *argv]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err, err
