"""An adapter wrapper that traces every storage batch call and counts its failures.

It wraps whatever backend was opened, so every adapter, third-party ones included, gets
`hicache.storage.<op>` spans under the transfer that issued the call, with no code of its own.
"""
from __future__ import annotations

from ..errors import StorageError
from ..telemetry import spans
from ..topology import RankCoords
from .base import StorageAdapter
from .wrapping import WrappingStorage


class TracedStorage(WrappingStorage):
    def __init__(self, inner: StorageAdapter, coords: RankCoords, backend: str) -> None:
        super().__init__(inner)
        self.coords, self.backend = coords, backend
        self.metrics = spans.CacheMetrics()

    def _through(self, op: str, keys: list[str], call):
        with spans.storage_span(op, keys=len(keys), coords=self.coords, backend=self.backend):
            try:
                return call()
            except StorageError:
                self.metrics.storage_error(self.backend, op)
                raise
