"""A third party's backend, written as one would: the contract's abstract methods only, so
reads go through its default `batch_get_parts`, and `batch_get` writes into the buffers it
was given whether or not anyone still waits (it never asks `call_abandoned`). Every read
takes `slow_read_s`; one that ends after its caller gave up is noted (`late_reads`, the
bytes it wrote in `late_bytes`, and a line in `slow_log`), so a test can tell the late
writes really happened. `SlowZeroCopy` reads into the caller's own parts instead, as a
zero-copy backend does, late or not."""
import time

from hicache_async.storage.base import MISSING, WRONG_SIZE, StorageAdapter, call_abandoned


class SlowReads(StorageAdapter):
    @classmethod
    def add_options(cls, group):
        group.add_argument("--slow-read-s", type=float, default=0.5, help="seconds every read takes")
        group.add_argument("--slow-log", metavar="PATH", help="a line here for each read that ends late")

    def __init__(self, slow_read_s: float = 0.5, slow_log: str | None = None, **_options) -> None:
        self.read_s, self.log = slow_read_s, slow_log
        self.objects: dict[str, bytes] = {}
        self.late_reads = self.late_bytes = 0
        self.on_late = lambda: None       # a test's probe, called as a late read ends

    def batch_exists(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n

    def batch_set(self, keys, values):
        self.objects.update((k, bytes(v)) for k, v in zip(keys, values))
        return [True] * len(keys)

    def batch_get(self, keys, buffers):
        time.sleep(self.read_s)
        out = []
        for key, buf in zip(keys, buffers):
            blob = self.objects.get(key)
            if blob is None or len(blob) > buf.nbytes:
                out.append(MISSING if blob is None else WRONG_SIZE)
                continue
            memoryview(buf).cast("B")[:len(blob)] = blob
            out.append(len(blob))
        if call_abandoned():
            self._noted_late(out)
        return out

    def _noted_late(self, out: list[int]) -> None:
        """A read that ended after its caller gave up on it, with its results `out`."""
        self.late_reads += 1
        self.late_bytes += sum(n for n in out if n > 0)
        self.on_late()
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{sum(n for n in out if n > 0)} bytes read late\n")

    def close(self):
        pass


class SlowZeroCopy(SlowReads):
    """Reads the way a zero-copy transfer engine does: straight into the parts the caller gave,
    and a transfer under way is not recalled, so a read that ends after its caller gave up
    writes into them all the same (each such part is noted in `late_parts`)."""

    def __init__(self, *args, **options) -> None:
        super().__init__(*args, **options)
        self.late_parts: list[memoryview] = []

    def batch_get_parts(self, keys, parts, landed=None):
        time.sleep(self.read_s)
        late, out = call_abandoned(), []
        for key, ps in zip(keys, parts):
            blob, views = self.objects.get(key), [memoryview(p).cast("B") for p in ps]
            if blob is None or len(blob) != sum(v.nbytes for v in views):
                out.append(MISSING if blob is None else WRONG_SIZE)
                continue
            at = 0
            for view in views:
                view[:] = blob[at:at + view.nbytes]
                at += view.nbytes
            out.append(len(blob))
            if late:
                self.late_parts += views
        if late:
            self._noted_late(out)
        if landed is not None:
            landed(0, out)
        return out


class SlowWrites(SlowZeroCopy):
    """Writes the way a zero-copy engine does: each object's parts are read as its transfer
    runs, `slow_write_s` after the last one, so a writer still running reads host memory
    whatever it holds by then."""

    def __init__(self, *args, slow_write_s: float = 0.2, **options) -> None:
        super().__init__(*args, **options)
        self.write_s = slow_write_s

    def batch_set_parts(self, keys, parts, ready=None):
        for i, (key, ps) in enumerate(zip(keys, parts)):
            if key in self.objects:
                continue
            time.sleep(self.write_s)
            if ready is not None:
                ready(i)
            self.objects[key] = b"".join(bytes(p) for p in ps)
        return [True] * len(keys)
