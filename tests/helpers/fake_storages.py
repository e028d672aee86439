"""Storages that misbehave on cue, for unit tests of the classes that must survive them: the
in-process store made slow, hung or down, as a real backend can be."""
import threading
import time

from hicache_async.errors import StorageError
from hicache_async.storage.base import call_abandoned
from hicache_async.storage.memory import MemoryStorage


class SlowStorage(MemoryStorage):
    """Every object read or written takes a fixed time, like a backend limited by bandwidth."""

    seconds_per_object = 0.0

    def batch_set(self, keys, values):
        time.sleep(self.seconds_per_object * len(keys))
        return super().batch_set(keys, values)

    def batch_get(self, keys, buffers):
        time.sleep(self.seconds_per_object * len(keys))
        return super().batch_get(keys, buffers)


class HangingStorage(MemoryStorage):
    """Reads and writes block for good once `calls_left` runs out, like a backend whose server
    stopped answering mid-run."""

    def __init__(self, calls_left: int = 0) -> None:
        super().__init__()
        self.calls_left = calls_left
        self.release = threading.Event()      # set at teardown, so no thread outlives the test
        self.woke_abandoned = []

    def _maybe_hang(self) -> None:
        self.calls_left -= 1
        if self.calls_left < 0:
            self.release.wait(timeout=30)
            self.woke_abandoned.append(call_abandoned())

    def batch_set(self, keys, values):
        self._maybe_hang()
        return super().batch_set(keys, values)

    def batch_get(self, keys, buffers):
        self._maybe_hang()
        return super().batch_get(keys, buffers)


class DownStorage(MemoryStorage):
    """Every call fails at once while `down` is set, like a backend whose server went away;
    `calls` counts the calls that reached it."""

    down = True
    calls = 0

    def _answer(self) -> None:
        self.calls += 1
        if self.down:
            raise StorageError("connection refused")

    def batch_exists(self, keys):
        self._answer()
        return super().batch_exists(keys)

    def batch_set(self, keys, values):
        self._answer()
        return super().batch_set(keys, values)

    def batch_get(self, keys, buffers):
        self._answer()
        return super().batch_get(keys, buffers)
