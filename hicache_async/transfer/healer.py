"""The healer: the page store's memory of objects to rewrite, and its proof that each is ours.

Backups skip keys already stored, so an object that fails verification would be a miss for
every reader, for good, and with it every page after it in its prefix. A prefetch stops at
the first bad object, so what it learns is about that object alone: the objects after it in
the prefix were never read. So when it ends at an object that is, or may be, a broken copy
of this reader's own (`found`), the healer remembers that key and every key after it in
the prefetch as *doubted*, and the next backup of a doubted key checks it first (`heal`):
one read of the whole object, verified as a prefetch would. A damaged copy of ours is removed
(`batch_remove`) just before the backup writes it afresh; a valid object is kept, unwritten;
a missing one is simply written; anything else is left alone. So one recompute, whose backups
cover the whole prefix past the verified run, rewrites every damaged object in it.

That read is the cheapest proof the rule below allows: a header alone cannot tell a flipped
payload byte from a valid object of other bytes (a recompute need not give the same bits);
judging the rest inside the prefetch would put checksums (and, past its first storage call,
reads) on a request's path, and a prefetch never reads a shorter object's header. The read
runs once per damage, on the backup's thread, for at most the objects that backup would
otherwise write, and a key is forgotten once checked, whatever the verdict.

The healer removes only what it can prove is a damaged copy of what this reader writes: an
object of the expected size whose header is of this format and tenant but whose bytes or
fields do not check out, or has no header at all (the zeros a crash leaves in blocks never
written), as `objects.damaged` decides; or a shorter one whose header is ours field for field,
length included (`objects.cut_short`): a copy of ours cut short. Anything else may be another
writer's and stays, a miss: another tenant or format version, a shorter or longer object
with another header or none (another layer partition, a draft model, an empty file), anything
a sealed store cannot open (AES-GCM cannot tell a flipped byte from another secret's object).
Deleting those would let one writer wipe another's objects, which its own healer, finding ours
in their place, would leave: neither would ever hit again. Only a writer of the right bytes
removes, at once before it writes, never a reader: a healer that removes what another just
wrote stores the same good bytes again, and only a failed write leaves the key empty.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

from ..errors import StorageError
from ..storage.base import StorageAdapter
from ..storage.staging import StagingPool
from .objects import HEADER_BYTES, cut_short, damaged, intact

DOUBTED_KEYS = 1 << 15   # most keys a store remembers for their next backup (a few MiB)
PROOF_BYTES = 32 << 20   # most bytes one proof read holds


class Healer:
    def __init__(self, adapter: StorageAdapter, staging: StagingPool, count_error: Callable[[], None]) -> None:
        self.adapter, self.staging, self._count_error = adapter, staging, count_error
        self._doubted: dict[str, bool] = {}   # key -> proven damaged already; oldest first
        self._lock = threading.Lock()

    def found(self, keys: list[str], proven: bool) -> None:
        """A prefetch ended at `keys[0]`, `proven` a damaged copy of ours, or one that may be
        (a shorter object, judged by its header later); `keys[1:]` were not read. Beyond the
        bound, the earliest keys are kept: a prefix is served up to its first bad object."""
        with self._lock:
            for i, key in enumerate(keys[:DOUBTED_KEYS]):
                self._doubted[key] = proven and i == 0
            while len(self._doubted) > DOUBTED_KEYS:
                del self._doubted[next(iter(self._doubted))]

    def heal(self, keys: list[str], sizes: list[int], prefix: Callable[[int], bytes]) -> set[str]:
        """Those of `keys` (objects of `sizes` payload bytes, `prefix(j)` the header fields
        before the checksum that key j's must carry) proven damaged copies of ours, removed
        from storage so the write that follows stores them afresh. Every doubted key among them
        is forgotten: if a removal fails, the write skips the object and the next prefetch
        finds it again."""
        if not self._doubted:
            return set()
        with self._lock:
            doubted = [(j, self._doubted.pop(keys[j])) for j in range(len(keys)) if keys[j] in self._doubted]
        proven = {keys[j] for j, known in doubted if known}
        try:
            proven.update(keys[j] for j in self._prove([j for j, known in doubted if not known], keys, sizes, prefix))
        except StorageError:
            self._count_error()
        if proven:
            try:
                self.adapter.batch_remove(sorted(proven))
            except StorageError:
                self._count_error()
                return set()
        return proven

    def _prove(self, todo: list[int], keys: list[str], sizes: list[int], prefix: Callable[[int], bytes]) -> list[int]:
        """Those of `todo` whose objects, read whole, are damaged copies of ours: read as a
        prefetch reads them (header and payload apart, as a sealed store authenticates them),
        then the shorter ones again, whole, for their headers (a read into parts leaves a
        shorter object unread)."""
        out, start = [], 0
        while start < len(todo):
            stop, room = start + 1, HEADER_BYTES + sizes[todo[start]]
            while stop < len(todo) and room + HEADER_BYTES + sizes[todo[stop]] <= PROOF_BYTES:
                room += HEADER_BYTES + sizes[todo[stop]]
                stop += 1
            group = todo[start:stop]
            with self.staging.lease(room) as staging:
                views, at = [], 0
                for j in group:
                    views.append(staging[at:at + HEADER_BYTES + sizes[j]])
                    at += HEADER_BYTES + sizes[j]
                got = self.adapter.batch_get_parts([keys[j] for j in group],
                                                   [[view[:HEADER_BYTES], view[HEADER_BYTES:]] for view in views])
                out += [j for j, n, view in zip(group, got, views)
                        if n == view.nbytes and _damaged(view, prefix(j))]
                short = [(j, view[:n]) for j, n, view in zip(group, got, views) if HEADER_BYTES <= n < view.nbytes]
                if short:
                    again = self.adapter.batch_get([keys[j] for j, _ in short], [view for _, view in short])
                    out += [j for (j, view), n in zip(short, again)
                            if n == view.nbytes and cut_short(view[:HEADER_BYTES], prefix(j))]
            start = stop
        return out


def _damaged(blob: memoryview, prefix: bytes) -> bool:
    """Whether an object of the expected size, read into `blob`, is a damaged copy of ours."""
    header, payload = blob[:HEADER_BYTES], blob[HEADER_BYTES:]
    return not intact(header, prefix, payload) and damaged(header, prefix)
