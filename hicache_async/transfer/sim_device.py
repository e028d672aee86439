"""A simulated device on the CPU: the device seam's other side, on which CI runs `StreamCopies`,
and through it `BlockCopies`' and the `Copier`'s device paths, byte for byte, as FoundationDB
runs its code over a simulated network and disk.

Each stream is a thread of its own that runs its operations in the order they were queued,
each after a seeded random delay, so copies land later than issued; a batch's descriptors run
in a seeded random order (the driver promises none) as real `memmove`s. An event passes when
its stream reaches it; a stream waiting on an event blocks its thread until it passes, at most
`wait_s`, then fails as a device does: it and every event recorded on it after report the
error. The compute stream is the caller's thread: what it runs (the forward pass, a test's
writes) is done when issued, and waiting on an event there blocks the caller, bounded.

"Pinned" here means registered (`register`): the registrations are a pool's chunks, and a
descriptor whose range in them spans two is refused, as the driver refuses a DMA across two
`cudaHostRegister` calls. Faults a test injects: the next batch refused at issue, or after its
first `k` descriptors (those queued, the rest not); the next event never passing. Threads are
daemons, stopped by `close`.
"""
from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from ..errors import CopyFailed
from ..pools import HostPool
from .device import SourceOrder
from .dma import memmove
from .dma_plan import Descriptors


class SimEvent:
    def __init__(self, device: SimDevice) -> None:
        self._device = device
        self.passed, self.error = True, None     # never recorded: passed, as on CUDA

    def record(self, stream: SimStream | _CallerStream) -> None:
        if isinstance(stream, SimStream) and self._device.stalls():
            stream.stall(self)
        else:
            stream.record(self)

    def query(self) -> bool:
        with self._device.changed:
            if self.error is not None:
                raise RuntimeError(self.error)
            return self.passed


class SimStream:
    """A thread running this stream's operations in order, each later than issued."""

    def __init__(self, device: SimDevice, name: str, rng: random.Random) -> None:
        self._device, self._rng = device, rng
        self._ops: deque[Callable[[], None]] = deque()
        self.error: str | None = None             # sticky, as a device's
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def record(self, event: SimEvent) -> None:
        with self._device.changed:
            event.passed, event.error = False, None
        self.queue(lambda: self._pass(event))

    def wait_event(self, event: SimEvent) -> None:
        self.queue(lambda: self._wait(event))

    def synchronize(self) -> None:
        """Bounded: raises if the stream makes no progress for `wait_s`."""
        device = self._device
        with device.changed:
            while self._ops:
                left = len(self._ops)
                if not device.changed.wait_for(lambda: len(self._ops) < left or device.closed, device.wait_s):
                    raise RuntimeError(f"simulated device: {self._thread.name} made no progress in {device.wait_s} s")
                if device.closed:
                    return

    def queue(self, op: Callable[[], None]) -> None:
        with self._device.changed:
            self._ops.append(op)
            self._device.changed.notify_all()

    def stall(self, event: SimEvent) -> None:
        """The event never passes: the stream hangs there for `bound_s`, then fails."""
        with self._device.changed:
            event.passed, event.error = False, None
        self.queue(lambda: self._hang(event))

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        device = self._device
        while True:
            with device.changed:
                device.changed.wait_for(lambda: self._ops or device.closed)
                if device.closed:
                    return
                op = self._ops[0]
            device.stopping.wait(self._rng.uniform(0, device.max_delay_s))
            op()
            with device.changed:
                self._ops.popleft()
                device.changed.notify_all()

    def copy(self, copy: Descriptors) -> None:
        if self.error is None:
            order = self._rng.sample(range(len(copy)), len(copy))
            memmove(Descriptors(*(side[order] for side in copy)))

    def _pass(self, event: SimEvent) -> None:
        with self._device.changed:
            event.passed, event.error = self.error is None, self.error

    def _wait(self, event: SimEvent) -> None:
        device = self._device
        with device.changed:
            if not device.changed.wait_for(lambda: event.passed or event.error or device.closed, device.wait_s):
                self.error = f"simulated device: {self._thread.name} waited {device.wait_s} s on an event"
            self.error = self.error or event.error

    def _hang(self, event: SimEvent) -> None:
        device = self._device
        device.stopping.wait(device.bound_s)
        with device.changed:
            self.error = self.error or (f"simulated device: an event on {self._thread.name} did not pass within "
                                        f"{device.bound_s} s")
            event.error = self.error


class _CallerStream:
    """The compute stream: the caller's thread, whose work is done when issued."""

    def __init__(self, device: SimDevice) -> None:
        self._device = device

    def record(self, event: SimEvent) -> None:
        with self._device.changed:
            event.passed, event.error = True, None

    def wait_event(self, event: SimEvent) -> None:
        """Blocks the caller until `event` passes, at most `wait_s`; raises what failed it."""
        device = self._device
        with device.changed:
            if not device.changed.wait_for(lambda: event.passed or event.error, device.wait_s):
                raise RuntimeError(f"simulated device: the compute stream waited {device.wait_s} s on an event")
        if event.error is not None:
            raise RuntimeError(event.error)

    def synchronize(self) -> None:
        """Its work is done when issued."""


class SimDevice:
    """The device seam on the CPU (see the module); `seed` decides every delay and order."""

    def __init__(self, seed: int = 0, max_delay_s: float = 1e-3, bound_s: float = 5.0) -> None:
        self.seed, self.max_delay_s, self.bound_s = seed, max_delay_s, bound_s
        self.wait_s = 2 * bound_s + max_delay_s   # any wait's bound: past a stall, so a waiter sees its failure
        self.changed = threading.Condition()      # any event passing, op done or stream failing
        self.stopping = threading.Event()         # cuts the delays and hangs short at close
        self.closed = False
        self.capturing_graph = False              # a test sets it: the caller's stream captures a graph
        self.orders: list[SourceOrder] = []       # each batch's declared source order, in issue order
        self._streams: list[SimStream] = []
        self._caller = _CallerStream(self)
        self._registered: list[tuple[int, int, int]] = []     # (first byte, past the last, chunk bytes)
        self._bound = threading.local()
        self._failing: dict[int, int] = {}        # batch number -> descriptors it queues before it is refused
        self._issued = 0                          # batches issued so far
        self._stalling = 0                        # events on copy streams still to stall

    def register(self, host: HostPool) -> None:
        """The pool's memory pinned, a registration every `host.chunk_bytes` from its first byte."""
        start = host.tensor.data_ptr()
        self._registered.append((start, start + host.tensor.untyped_storage().nbytes(), host.chunk_bytes))

    def fail_batch(self, after: int = 0, skip: int = 0) -> None:
        """The batch issued `skip` batches from now is refused after queuing its first `after`
        descriptors."""
        self._failing[self._issued + skip] = after

    def stall_event(self) -> None:
        """The next event recorded on a copy stream never passes (its stream fails after `bound_s`)."""
        with self.changed:
            self._stalling += 1

    def stream(self) -> SimStream:
        n = len(self._streams)
        stream = SimStream(self, f"sim-stream-{n}", random.Random(f"{self.seed}:{n}"))
        self._streams.append(stream)
        return stream

    def current_stream(self) -> _CallerStream:
        return self._caller

    def event(self) -> SimEvent:
        return SimEvent(self)

    def capturing(self) -> bool:
        return self.capturing_graph

    def bind(self) -> None:
        self._bound.device = True

    def pinned(self, host: HostPool) -> bool:
        start = host.tensor.data_ptr()
        return any(first <= start < end for first, end, _ in self._registered)

    def check_host_pointers(self) -> None:
        """The simulated device takes a registered host pointer as is."""

    def copy(self, copy: Descriptors, stream: SimStream, order: SourceOrder) -> None:
        if not getattr(self._bound, "device", False):
            raise CopyFailed(f"simulated device: a batch issued from {threading.current_thread().name}, a thread "
                             "never bound to it")
        with self.changed:
            self.orders.append(order)
            refused = min(self._spanning(copy), self._failing.pop(self._issued, len(copy)))
            self._issued += 1
        if refused < len(copy):
            if refused:
                stream.queue(lambda: stream.copy(Descriptors(*(side[:refused] for side in copy))))
            raise CopyFailed(f"simulated batch of {len(copy)} copies refused at copy {refused}")
        stream.queue(lambda: stream.copy(copy))

    def close(self) -> None:
        """Stops every stream's thread, dropping what it had not run."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        self.stopping.set()
        for stream in self._streams:
            stream.join(self.bound_s)

    def stalls(self) -> bool:
        """Whether the event being recorded on a copy stream is one a test doomed (taken)."""
        with self.changed:
            doomed, self._stalling = self._stalling > 0, max(0, self._stalling - 1)
        return doomed

    def _spanning(self, copy: Descriptors) -> int:
        """The first descriptor whose range in a registration runs past its chunk (len if none)."""
        bad = np.zeros(len(copy), dtype=bool)
        for first, end, chunk in self._registered:
            for at in (copy.src, copy.dst):
                inside = (at >= first) & (at < end)
                bad |= inside & ((at - first) // chunk != (at + copy.size - 1 - first) // chunk)
        return int(np.argmax(bad)) if bad.any() else len(copy)

