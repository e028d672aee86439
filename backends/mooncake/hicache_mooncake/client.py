"""A rank's connection to a Mooncake master: set up fast or fail, closed only once no call is inside.

The zero-copy batch calls (`adapter.py`) run on top of it; the backend's command-line flags and
per-run master (`session.py`) hang off it as the class-level hooks of the storage contract.

Objects live in a segment some client mounts. A rank client mounts none by default
(`segment_bytes=0`): its puts land in the segment holder started beside the master (see
`holder.py`), so they outlive the rank. Give it `segment_bytes` only against a master with
no holder, knowing those objects go when the client closes.
"""
from __future__ import annotations

import functools
import logging
import threading

from hicache_async.errors import StorageError, UsageError
from hicache_async.storage.base import StorageAdapter

from . import session
from .master import check_reachable, default_metadata_url

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 5.0   # how long close waits for calls still inside the client (a hung one)


def in_call(method):
    """Counts a call while it is inside the client, so that `close` never frees it underneath."""
    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        with self._calls:
            if self._closed:
                raise StorageError("mooncake storage is closed")
            self._in_flight += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._calls:
                self._in_flight -= 1
                self._calls.notify_all()
    return counted


class MooncakeClient(StorageAdapter):
    """A `MooncakeDistributedStore` set up against one master, and the memory registered with it."""

    add_options = staticmethod(session.add_options)
    open_session = staticmethod(session.open_session)

    def __init__(self, master: str = "127.0.0.1:50051", metadata_url: str | None = None,
                 segment_bytes: int = 0, buffer_bytes: int = 64 << 20,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "",
                 connect_timeout_s: float = 3.0, **_options) -> None:
        self.master = master
        self.metadata_url = metadata_url or default_metadata_url(master)
        # setup() retries for ~90 s against a dead master; probe first so that fails fast.
        check_reachable(master, self.metadata_url, connect_timeout_s)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise UsageError(session.NEEDS_EXTRA) from None
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, self.metadata_url, segment_bytes, buffer_bytes,
                               protocol, device_name, master)
        if rc != 0:
            raise StorageError(f"mooncake setup against master {master} failed with code {rc}")
        self._regions: list[tuple[int, int]] = []   # registered (start, end), unregistered by close
        self._lock = threading.Lock()
        self._closed = False
        self._calls = threading.Condition()
        self._in_flight = 0

    def close(self) -> None:
        """Close the client once no call is inside it: freeing it under a call abandoned by
        its deadline (a dead master) would crash the process."""
        with self._calls:
            if self._closed:
                return
            self._closed = True
            if not self._calls.wait_for(lambda: self._in_flight == 0, CLOSE_WAIT_S):
                log.warning("mooncake storage: %d calls still inside the client after %g s; it is "
                            "left to process exit", self._in_flight, CLOSE_WAIT_S)
                return
        for start, _ in self._regions:
            self._store.unregister_buffer(start)
        self._store.close()
