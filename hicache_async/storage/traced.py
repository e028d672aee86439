"""An adapter wrapper that traces every storage batch call and counts its failures.

It wraps whatever backend was opened, so every adapter, third-party ones included, gets
`hicache.storage.<op>` spans under the transfer that issued the call, with no code of its own.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import StorageError
from ..telemetry import spans
from ..topology import RankCoords
from .base import StorageAdapter


class TracedStorage(StorageAdapter):
    def __init__(self, inner: StorageAdapter, coords: RankCoords, backend: str) -> None:
        self.inner, self.coords, self.backend = inner, coords, backend
        self.metrics = spans.CacheMetrics()

    def _call(self, op: str, keys: list[str], call, *args):
        with spans.storage_span(op, keys=len(keys), coords=self.coords, backend=self.backend):
            try:
                return call(keys, *args)
            except StorageError:
                self.metrics.storage_error(self.backend, op)
                raise

    def batch_exists(self, keys: list[str]) -> int:
        return self._call("batch_exists", keys, self.inner.batch_exists)

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        return self._call("batch_set", keys, self.inner.batch_set, values)

    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        return self._call("batch_get", keys, self.inner.batch_get, buffers)

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        return self._call("batch_set", keys, self.inner.batch_set_parts, parts, ready)

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        landed: Callable[[int, list[int]], None] | None = None) -> list[int]:
        return self._call("batch_get", keys, self.inner.batch_get_parts, parts, landed)

    def register_memory(self, view: memoryview) -> None:
        self.inner.register_memory(view)

    def close(self) -> None:
        self.inner.close()
