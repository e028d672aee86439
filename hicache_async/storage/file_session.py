"""Where a run's file storage lives: `--storage-path`, else a per-user cache directory that
later runs share, or, for a run that wants a cold L3 (replay), a scratch directory it deletes.
Directories the store creates are its user's alone (0700): KV is what the prompts said."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import StorageError


def add_options(group) -> None:
    group.add_argument("--storage-path", metavar="DIR",
                       help="file storage directory (default: simulate a per-user cache, "
                            "replay a fresh temporary one)")


def default_storage_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache-async", "kv")


@contextlib.contextmanager
def open_session(options: dict, capacity_bytes: int | None, cold: bool, default_capacity: int) -> Iterator[dict]:
    """The directory every rank opens, created here so a bad path is one error before any rank."""
    with contextlib.ExitStack() as stack:
        path = options.get("storage_path")
        if path is None and cold:
            scratch = _scratch_dir(capacity_bytes or default_capacity)
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-l3-", dir=scratch))
        path = str(Path(path or default_storage_path()).expanduser())
        try:
            make_private_dirs(path)
        except OSError as e:
            raise StorageError(f"file storage {path}: cannot create directory: {e.strerror}") from None
        yield {"path": path} if capacity_bytes is None else {"path": path, "capacity_bytes": capacity_bytes}


def make_private_dirs(path: str) -> None:
    """Create `path` and its missing parents, each readable by this user only (0700);
    directories that exist are left as they are (a shared one is its owner's choice)."""
    parent = os.path.dirname(path)
    if parent and parent != path and not os.path.isdir(parent):
        make_private_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def _scratch_dir(capacity: int) -> str | None:
    """/dev/shm when $TMPDIR is unset and it has room for the whole capacity, else the default
    temporary directory. A trace leaves hundreds of thousands of one-off objects: in RAM they
    cost no disk writes and are deleted in seconds, where a disk mounted with `discard` takes
    minutes."""
    shm = "/dev/shm"
    if os.environ.get("TMPDIR") or not os.access(shm, os.W_OK):
        return None
    return shm if shutil.disk_usage(shm).free >= capacity else None
