"""Who still reads each host slot in the background, and the one rule they obey.

A backup reads its host slots on a worker thread, perhaps long after the step that issued
it. If a slot were rewritten first, the backup would checksum and store another page's
bytes under this page's key, and every reader of L3 would verify and serve them. So:
a slot has readers, and a rewrite waits for all of them. A slot whose readers outlast the
deadline is not rewritten at all: it turns stale, and a load from it is a load error (vLLM
recomputes those blocks) until a later write lands in it.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, wait


class SlotReaders:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[int, set[Future]] = {}
        self.stale: set[int] = set()
        self._news: set[int] = set()     # turned stale since `newly_stale` last asked

    def add(self, slots: list[int], reader: Future) -> None:
        """`reader` reads `slots` until it is done."""
        with self._lock:
            for slot in slots:
                self._readers.setdefault(slot, set()).add(reader)
        reader.add_done_callback(lambda done: self._drop(slots, done))

    def _drop(self, slots: list[int], reader: Future) -> None:
        with self._lock:
            for slot in slots:
                readers = self._readers.get(slot)
                if readers is not None:
                    readers.discard(reader)
                    if not readers:
                        del self._readers[slot]

    def writable(self, slots: list[int], timeout: float) -> list[bool]:
        """Wait, up to `timeout` seconds, for every reader of `slots`; per slot, whether it
        may be rewritten now. One that may not has turned stale."""
        with self._lock:
            pending = {r for s in slots for r in self._readers.get(s, ())}
        if pending:
            wait(pending, timeout=timeout)
        with self._lock:
            ok = [not self._readers.get(s) for s in slots]
            turned = {s for s, fine in zip(slots, ok) if not fine}
            self.stale |= turned
            self._news |= turned
            return ok

    def newly_stale(self) -> set[int]:
        """Slots that turned stale since the last call: each is reported once."""
        with self._lock:
            news, self._news = self._news, set()
            return news

    def written(self, slots: list[int]) -> None:
        """These slots hold a whole new page: no longer stale."""
        with self._lock:
            self.stale.difference_update(slots)

    def busy(self) -> int:
        """Slots some reader still reads: the backup queue's depth, in pages."""
        with self._lock:
            return len(self._readers)
