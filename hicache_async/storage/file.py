"""Embedded L3: one file per object under a directory that several processes may share.

Writes go to a temp file in the object's own directory, named with a leading dot (object
names never start with one), that is renamed into place: a reader sees a whole object or
none, and a temp file a crash left behind is never read, never counted against capacity,
and removed by the next store to open the directory once it is an hour old. There is no
fsync: an object torn by power loss fails verification, a miss, which the page store heals
where it can tell the object is its own (`batch_remove`, then a fresh write). Keys are
content-addressed, so an object already stored is not written again. The store is private
by default: directories it creates are 0700 and objects 0600. Eviction goes by mtime, the
time an object was written: a read changes nothing on disk, so reads cost no metadata write
and leave no trace of which prefixes were served, and the least recently written objects go
first, across every process sharing the directory. The keys this store evicts are kept for
`evicted`, so its caller can withdraw what it announced; not those whose file name is a digest
of a long key (it cannot be named back), and each process reports only its own evictions.
Each object is one `writev` or `readv` of all its parts, straight from and into the caller's
buffers.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import unquote

from ..errors import StorageError
from . import file_session
from .base import MISSING, WRONG_SIZE, StorageAdapter, call_abandoned

_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_MAX_NAME = 200
_LOW_WATERMARK = 0.9   # eviction frees down to this fraction of capacity
_STALE_TEMP_S = 3600
EVICTED_KEPT = 1 << 16  # evicted keys kept for `evicted`, the latest: a caller that never asks keeps no more
DEFAULT_CAPACITY = 8 << 30


def object_name(key: str) -> str:
    """File name for `key`: every byte outside [A-Za-z0-9_-] is %XX-escaped.

    So `/`, `.`, `..` and NUL cannot leave the directory or name a special entry. Names
    that would be too long become `~` + SHA-256 of the key (escaping never yields `~`).
    """
    if _ALL_SAFE.fullmatch(key):
        name = key
    else:
        name = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in key.encode())
    if not name or len(name) > _MAX_NAME:
        return "~" + hashlib.sha256(key.encode()).hexdigest()
    return name


class FileStorage(StorageAdapter):
    takes_capacity = True
    lands_each = True
    add_options = staticmethod(file_session.add_options)

    @classmethod
    def open_session(cls, options: dict, *, capacity_bytes: int | None = None, cold: bool = False):
        return file_session.open_session(options, capacity_bytes, cold, DEFAULT_CAPACITY)

    def __init__(self, path: str, capacity_bytes: int = DEFAULT_CAPACITY, **_options) -> None:
        if capacity_bytes <= 0:
            raise StorageError(f"file storage capacity must be positive, got {capacity_bytes}")
        self.root = Path(path).expanduser()
        self.capacity_bytes = capacity_bytes
        try:
            file_session.make_private_dirs(str(self.root))
        except OSError as e:
            raise StorageError(f"file storage {self.root}: cannot create directory: {e.strerror}") from None
        self._root = str(self.root)
        self._lock = threading.Lock()
        self._dirs: set[str] = set()  # fan-out directories known to exist
        self._evicted: deque[str] = deque(maxlen=EVICTED_KEPT)
        # temp file names: this process, this adapter, a serial: unique among the directory's writers
        self._temp_prefix, self._temp_names = f".{os.getpid()}-{uuid.uuid4().hex[:8]}-", itertools.count()
        self._used = self._scan(remove_stale=True)[1]

    def _path(self, key: str) -> str:
        name = object_name(key)
        return f"{self._root}/{name[:2]}/{name}"

    def _scan(self, remove_stale: bool = False) -> tuple[list[tuple[float, int, str]], int]:
        """(mtime, size, path) of every object, oldest first, and their total size."""
        entries, now = [], time.time()
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                p = os.path.join(dirpath, f)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                if f.startswith("."):
                    if remove_stale and now - st.st_mtime > _STALE_TEMP_S:
                        _unlink(p)
                    continue
                entries.append((st.st_mtime, st.st_size, p))
        entries.sort()
        return entries, sum(e[1] for e in entries)

    def _evict(self) -> None:
        """Delete the least recently written objects until usage is under the low watermark."""
        entries, used = self._scan()
        target = self.capacity_bytes * _LOW_WATERMARK
        for _, size, p in entries:
            if used <= target:
                break
            _unlink(p)
            used -= size
            key = _key_of(os.path.basename(p))
            if key is not None:
                self._evicted.append(key)
        self._used = used

    def evicted(self) -> list[str]:
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
        return out

    def batch_exists(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and os.path.isfile(self._path(keys[n])):
            n += 1
        return n

    def batch_remove(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StorageError(f"file storage {self.root}: cannot remove {key}: {e.strerror}") from None
            with self._lock:
                self._used -= size

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        return self.batch_set_parts(keys, [[v] for v in values])

    def batch_set_parts(self, keys: list[str], parts: list[Sequence],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        out = []
        for i, (key, ps) in enumerate(zip(keys, parts)):
            path = self._path(key)
            if call_abandoned():      # the caller has moved on: its buffers may hold other data
                return out + [False] * (len(keys) - i)
            if os.path.exists(path):
                out.append(True)
                continue
            views = [memoryview(p).cast("B") for p in ps]
            out.append(self._write(key, path, views, None if ready is None else lambda i=i: ready(i)))
        return out

    def _write(self, key: str, path: str, parts: list[memoryview], ready: Callable[[], None] | None) -> bool:
        """Write the object to a temp file in one `pwritev`, then rename it into place.

        `ready` first makes the parts final (the caller's header, checksummed from the payload,
        which the write then reads from cache).
        """
        size = sum(p.nbytes for p in parts)
        if size > self.capacity_bytes:
            return False
        if ready is not None:
            ready()
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f"{self._temp_prefix}{next(self._temp_names)}.tmp")
        try:
            if folder not in self._dirs:
                file_session.make_private_dirs(folder)
                self._dirs.add(folder)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                _write_at(fd, parts, 0)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(f"file storage {self.root}: cannot write {key}: {e.strerror}") from None
        with self._lock:
            self._used += size
            if self._used > self.capacity_bytes:
                self._evict()
        return True

    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        views = [memoryview(b).cast("B") for b in buffers]
        return [self._read(key, self._path(key), [v], v.nbytes, False) for key, v in zip(keys, views)]

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        landed: Callable[[int, list[int]], None] | None = None) -> list[int]:
        # Names and sizes first: the loop that streams the bytes in (evicting all else from
        # cache) then runs as little Python per object as it can.
        paths, rooms = [self._path(key) for key in keys], [sum(p.nbytes for p in ps) for ps in parts]
        out = []
        for i, (key, path, ps, room) in enumerate(zip(keys, paths, parts, rooms)):
            out.append(self._read(key, path, ps, room, True))
            if landed is not None:
                landed(i, out[i:])
        return out

    def _read(self, key: str, path: str, parts: Sequence[memoryview], room: int, exact: bool) -> int:
        """One object in one `readv` straight into `parts`; with `exact`, one smaller than
        `room` is reported by its size, unread."""
        if call_abandoned():      # the caller has moved on: its buffers are not ours to fill
            return MISSING
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return MISSING
        except OSError as e:
            raise StorageError(f"file storage {self.root}: cannot open {key}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_size > room:
                return WRONG_SIZE
            if exact and st.st_size < room:
                return st.st_size
            got = os.readv(fd, parts)
        except OSError as e:
            raise StorageError(f"file storage {self.root}: cannot read {key}: {e.strerror}") from None
        finally:
            os.close(fd)
        return got if got == st.st_size else WRONG_SIZE

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""


def _key_of(name: str) -> str | None:
    """The key `object_name` named `name`; None for a digest of a long key."""
    return None if name.startswith("~") else unquote(name)


def _write_at(fd: int, parts: list[memoryview], offset: int) -> None:
    """All of `parts`, in order, at `offset`; a short write is resumed where it stopped."""
    while parts:
        done = os.pwritev(fd, parts, offset)
        offset += done
        while parts and done >= parts[0].nbytes:
            done -= parts[0].nbytes
            parts = parts[1:]
        if parts:
            parts[0] = parts[0][done:]


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
