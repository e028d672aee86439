"""`--storage` lists every backend registered in the `hicache_async.storage` entry points, so a
backend a third party installs shows up in `--help` and runs, with no change to our code."""
import json
import os
import subprocess
import sys

ENTRY_POINTS = "[hicache_async.storage]\nvault = vault_backend:VaultStorage\n"
BACKEND = '''
from hicache_async.storage.memory import MemoryStorage


class VaultStorage(MemoryStorage):
    """A third party's backend: here, the in-process store under another name."""
'''


def _installed(tmp_path) -> dict:
    """An environment where a package `vault-backend` is installed: its module and its dist-info."""
    (tmp_path / "vault_backend.py").write_text(BACKEND)
    info = tmp_path / "vault_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vault-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "XDG_CACHE_HOME": str(tmp_path / "xdg")}


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache_async", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_pip_installed_backend_appears_in_help_and_serves_l3(tmp_path):
    env = _installed(tmp_path)
    help_text = _cli(env, "simulate", "--help").stdout
    assert "vault" in help_text and "mooncake" in help_text and "file" in help_text
    assert "vault" not in _cli({**os.environ}, "simulate", "--help").stdout   # not installed: not offered
    done = _cli(env, "simulate", "--storage", "vault", "--requests", "8", "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["storage_used"] == "vault" and out["l3_bytes_written"] > 0 and out["kv_mismatches"] == 0
