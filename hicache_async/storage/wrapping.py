"""The base of every adapter that wraps another (guarding, tracing, sealing).

Each call goes to the inner adapter through `_through(op, keys, call)`, which by default
just makes it: a wrapper that acts on every call alike (a deadline, a span) overrides that
one method, and one that changes the objects (sealing) overrides the calls it changes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from .base import StorageAdapter

T = TypeVar("T")


class WrappingStorage(StorageAdapter):
    def __init__(self, inner: StorageAdapter) -> None:
        self.inner = inner

    @property
    def lands_each(self) -> bool:
        return self.inner.lands_each

    def _through(self, op: str, keys: list[str], call: Callable[[], T]) -> T:
        """Make one call of the inner adapter; `op` names it as the contract does."""
        return call()

    def batch_exists(self, keys: list[str]) -> int:
        return self._through("batch_exists", keys, lambda: self.inner.batch_exists(keys))

    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        return self._through("batch_set", keys, lambda: self.inner.batch_set(keys, values))

    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        return self._through("batch_get", keys, lambda: self.inner.batch_get(keys, buffers))

    def batch_remove(self, keys: list[str]) -> None:
        self._through("batch_remove", keys, lambda: self.inner.batch_remove(keys))

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        ready: Callable[[int], None] | None = None) -> list[bool]:
        return self._through("batch_set", keys, lambda: self.inner.batch_set_parts(keys, parts, ready))

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]],
                        landed: Callable[[int, list[int]], None] | None = None) -> list[int]:
        return self._through("batch_get", keys, lambda: self.inner.batch_get_parts(keys, parts, landed))

    def evicted(self) -> list[str]:
        return self.inner.evicted()

    def register_memory(self, view: memoryview) -> None:
        self.inner.register_memory(view)

    def close(self) -> None:
        self.inner.close()
