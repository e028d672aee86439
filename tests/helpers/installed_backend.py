"""A storage backend installed the way pip installs one (a dist-info with an entry point), for
a subprocess: what a third party's package looks like to the CLI and the launcher."""
import os
from pathlib import Path

REPO = str(Path(__file__).parents[2])


def installed_backend_env(tmp_path: Path, name: str, target: str) -> dict:
    """The environment of a subprocess where backend `name` is installed, its class at `target`
    ("module:Class", importable from `tmp_path` or the repository)."""
    info = tmp_path / f"{name}_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[hicache_async.storage]\n{name} = {target}\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), REPO, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}
