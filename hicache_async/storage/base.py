"""The L3 adapter protocol, and how a backend name becomes an adapter.

Adapters move opaque byte objects by key; they know nothing of KV layout. Each method is
one batch call, so a network backend pays one round trip per batch, not per page.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from importlib.metadata import entry_points

from ..errors import UsageError

ENTRY_POINT_GROUP = "hicache_async.storage"
MISSING = -1     # batch_get: the object is absent (or the read failed)
WRONG_SIZE = -2  # batch_get: the object is present but its size differs from the buffer's


class StorageAdapter(ABC):
    """An L3 backend. An outage raises `StorageError` with a one-line message.

    Methods may be called from several threads at once.
    """

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """Length of the leading run of `keys` that are present."""

    @abstractmethod
    def batch_set(self, keys: list[str], values: list) -> list[bool]:
        """Store each value (bytes-like) under its key; per-object success."""

    @abstractmethod
    def batch_get(self, keys: list[str], buffers: list[memoryview]) -> list[int]:
        """Read each object into its writable buffer.

        Per object: bytes read, `MISSING`, or `WRONG_SIZE` when it does not fit the buffer.
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections and memory; later calls are errors."""

    def register_memory(self, view: memoryview) -> None:
        """Hint that `view` will be a source or destination again (zero-copy backends pin it)."""

    def batch_set_parts(self, keys: list[str], parts: list[Sequence[memoryview]]) -> list[bool]:
        """Like batch_set, each object given as the concatenation of its parts."""
        return self.batch_set(keys, [b"".join(p) for p in parts])

    def batch_get_parts(self, keys: list[str], parts: list[Sequence[memoryview]]) -> list[int]:
        """Like batch_get, each object scattered over its parts in order.

        An object that does not fill its parts exactly is `WRONG_SIZE`.
        """
        sizes = [sum(p.nbytes for p in ps) for ps in parts]
        staging = [memoryview(bytearray(n)) for n in sizes]
        got = self.batch_get(keys, staging)
        out = []
        for ps, buf, n, size in zip(parts, staging, got, sizes):
            if n >= 0 and n != size:
                n = WRONG_SIZE
            if n == size:
                offset = 0
                for p in ps:
                    memoryview(p).cast("B")[:] = buf[offset:offset + p.nbytes]
                    offset += p.nbytes
            out.append(n)
        return out

    def __enter__(self) -> "StorageAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_storage(name: str, **options) -> StorageAdapter:
    """The adapter registered under `name` in the `hicache_async.storage` entry points."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        known = ", ".join(sorted(found)) or "none"
        raise UsageError(f"unknown storage {name!r}: known backends are {known}")
    return found[name].load()(**options)
