"""In-process L3: a dict of bytes. For tests and single-process runs; nothing survives exit."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..errors import StorageError
from .base import MISSING, WRONG_SIZE, StorageAdapter


class MemoryStorage(StorageAdapter):
    def __init__(self, **_options) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise StorageError("memory storage is closed")

    def batch_exists(self, keys: list[str]) -> int:
        self._check()
        n = 0
        with self._lock:
            while n < len(keys) and keys[n] in self._objects:
                n += 1
        return n

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        self._check()
        blobs = [bytes(v) for v in values]
        with self._lock:
            self._objects.update(zip(keys, blobs))
        return [True] * len(keys)

    def batch_remove(self, keys: list[str]) -> None:
        self._check()
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        """Objects already held are kept, unread (keys are content-addressed)."""
        self._check()
        with self._lock:
            new = [i for i, key in enumerate(keys) if key not in self._objects]
        for i in new if ready is not None else ():
            ready(i)
        stored = self.batch_set([keys[i] for i in new], [b"".join(parts[i]) for i in new]) if new else []
        out = [True] * len(keys)
        for i, ok in zip(new, stored):
            out[i] = ok
        return out

    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        self._check()
        out = []
        for key, buf in zip(keys, buffers):
            with self._lock:
                blob = self._objects.get(key)
            if blob is None:
                out.append(MISSING)
            elif len(blob) > buf.nbytes:
                out.append(WRONG_SIZE)
            else:
                memoryview(buf).cast("B")[:len(blob)] = blob
                out.append(len(blob))
        return out

    def close(self) -> None:
        self._closed = True
