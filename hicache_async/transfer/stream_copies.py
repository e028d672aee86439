"""Copies on a device (BlockCopies', the Copier's): every byte on the copy engines, loads and
saves on a stream each.

The SMs belong to the forward pass: an index kernel moving KV through the mapped pool slowed
a neighbouring matmul by 15-20 %, a DMA slows it by nothing. Each direction has a copy engine
of its own, so loads and saves get a stream each and overlap. A batch of thousands of
descriptors costs the driver milliseconds of CPU, so `load()` and `save()` only record where
the compute stream is and hand the copy to a thread of their direction (the driver call lets
go of the GIL); the threads issue in the order they were handed ops. A load issues a batch
and records an event a layer; `wait_layer` waits on the CPU, bounded, until that layer's
event is recorded, then makes the compute stream wait on it: nothing waits on an event not
yet recorded (`load_layers` also hands the layers out as events to poll from the CPU, as the
core's Copier does). A save is one batch over every layer.

Nothing orders the two streams against each other: `load()` no longer waits for the saves
handed over before it. What does, instead:
- the scheduler never loads from a host slot whose save has not landed on every worker, and
  never has a slot written while a load still reads it (it is reused only once its load is
  reported landed);
- a block loaded and saved in one step is ordered through the compute stream: `save()`
  first makes the compute stream wait on every layer of the step's loads, then the save
  stream waits on where the compute stream is;
- a device block is written (by a load or the forward pass) only once its saves have landed
  (vLLM keeps a finished request's blocks until we report them sent) or, for a preempted
  request's blocks, once `fence_saves` has put the compute stream behind them; a load's
  stream waits on where the compute stream was when it was handed over.

A batch refused part-way may have queued its first copies, and an op's later batches may
have queued more: the op's thread then records one more event after all of them, and the op
fails only once that event passed (a load's layers not landed wait on it too), so no slot is
reported free while a copy may still write it.

No copy is issued while the caller's stream captures a CUDA graph (the batch call is refused
there): such a load or save completes at once, failed. The device is a seam (`device.py`):
CUDA, or the simulated device the CPU tests run this very code over.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

from typing import NamedTuple

from ..errors import CopyFailed, UsageError
from ..events import CompletionEvent, HostEvent
from ..pools import HostPool
from .device import Device, Event, SourceOrder
from .dma_plan import DmaPlan

ISSUE_TIMEOUT_S = 30.0      # the most `wait_layer` waits for a layer's copies to be issued


class StreamCopies:
    """DMA between a device's per-layer KV blocks and a pinned host pool (see the module)."""

    def __init__(self, plan: DmaPlan, host: HostPool, device: Device, layers: int) -> None:
        """`device` owned from here on: `close` closes it."""
        if not device.pinned(host):
            raise UsageError("the host pool must be pinned for device copies: create it after the rank's CUDA "
                             "device is set")
        device.check_host_pointers()
        self.plan, self.layers, self.device = plan, layers, device
        self._streams = {kind: device.stream() for kind in ("load", "save")}
        self._threads = {kind: ThreadPoolExecutor(1, thread_name_prefix=f"hicache-{kind}", initializer=device.bind)
                         for kind in ("load", "save")}
        self._landing: _Landing | None = None     # the current loads' layers, as the load thread records them
        self._pending: list[int] = []             # their layers the compute stream has not waited on
        self._saving: Future | None = None        # the last save handed to the save thread
        self._saved: Event | None = None          # the last save's last event its thread recorded
        self._closed = False

    def load(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        """After the current loads (for the compute stream)."""
        return self.load_layers(slots, blocks)[-1]

    def load_layers(self, slots: list[int], blocks: list[int]) -> list[CompletionEvent]:
        """`load`, with an event a layer for a caller whose forward pass waits for a layer on the
        CPU (the core's Copier) rather than through `wait_layer`: done once the layer's copies
        landed, failed if the load failed before queuing them; the last is the load's."""
        what = f"load of {len(slots)} blocks"
        refused = self._refused(what)
        if refused is not None:
            return [refused] * self.layers
        if not slots:
            return [done()] * self.layers
        landing = _Landing()
        self._landing, self._pending = landing, list(range(self.layers))
        issued = self._hand_over("load", self._issue_load, landing, list(slots), list(blocks))
        issued.add_done_callback(landing.settle)
        loaded = _Issued(issued, what)
        return [_LayerLanded(landing, layer, loaded) for layer in range(self.layers - 1)] + [loaded]

    def save(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        what = f"save of {len(slots)} blocks"
        refused = self._refused(what)       # a block loaded this step may be saved: it goes behind its layers
        if refused is not None:
            return refused
        self._saving = self._hand_over("save", self._issue_save, list(slots), list(blocks))
        return _Issued(self._saving, what)

    def wait_layer(self, layer: int) -> None:
        """Nothing while a graph is captured: its recorded wait would outlive this load."""
        if layer not in self._pending or self.device.capturing():
            return
        landed = self._landing.recorded(layer, ISSUE_TIMEOUT_S)
        if landed is not None:
            self.device.current_stream().wait_event(landed)
        self._pending.remove(layer)

    def wait_loads(self) -> None:
        """The last layer's event covers the others: one stream, in order."""
        if self._pending:
            self._pending = [max(self._pending)]
            self.wait_layer(self._pending[0])

    def fence_saves(self, timeout_s: float) -> None:
        """The compute stream waits for every save handed over so far; the CPU waits only until
        their copies are issued, at most `timeout_s`."""
        if self._saving is None or self.device.capturing():
            return
        if not wait([self._saving], timeout=timeout_s).done:
            raise CopyFailed(f"fence_saves: the saves handed over were not issued within {timeout_s} s")
        if self._saved is not None:
            self.device.current_stream().wait_event(self._saved)

    def close(self) -> None:
        """Issues what was handed over, stops the threads, waits for both streams and closes the
        device."""
        if self._closed:
            return
        self._closed = True
        for thread in self._threads.values():
            thread.shutdown(wait=True)
        for stream in self._streams.values():
            stream.synchronize()
        self.device.close()

    def _refused(self, what: str) -> HostEvent | None:
        """None once the compute stream waits on the current loads; a failed event instead
        while a graph is captured or if their copies were never issued."""
        if self.device.capturing():
            return _failed(f"{what} refused: a CUDA graph is being captured")
        try:
            self.wait_loads()
        except CopyFailed as exc:
            return _failed(f"{what} refused: {exc}")
        return None

    def _hand_over(self, kind: str, issue, *args) -> Future:
        """The op to its direction's thread, behind the compute stream's work so far; a refused
        hand-over (closed, or a thread that could not start) is a failed future."""
        after = self.device.event()
        after.record(self.device.current_stream())
        try:
            return self._threads[kind].submit(issue, after, *args)
        except RuntimeError as exc:
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    def _issue_load(self, after: Event, landing: _Landing, slots: list[int], blocks: list[int]) -> _Outcome:
        """The load thread: a batch and an event a layer. Nothing writes a host slot while its
        load reads it (the slot rules), so the batch may read its sources in any order."""
        stream = self._streams["load"]
        stream.wait_event(after)
        try:
            for copy in self.plan.layers(slots, blocks, load=True):
                self.device.copy(copy, stream, SourceOrder.ANY)
                landing.record(self._after(stream))
        except Exception as exc:    # noqa: BLE001 - the op fails once what was queued has passed
            return _Outcome(self._after(stream), exc)
        return _Outcome(landing.last, None)

    def _issue_save(self, after: Event, slots: list[int], blocks: list[int]) -> _Outcome:
        """The save thread: one batch over every layer, behind the blocks as the forward pass
        left them, read in stream order."""
        stream = self._streams["save"]
        stream.wait_event(after)
        failure = None
        try:
            self.device.copy(self.plan.whole(slots, blocks, load=False), stream, SourceOrder.STREAM)
        except Exception as exc:    # noqa: BLE001 - the op fails once what was queued has passed
            failure = exc
        self._saved = self._after(stream)
        return _Outcome(self._saved, failure)

    def _after(self, stream) -> Event:
        """An event after everything queued on `stream` so far."""
        event = self.device.event()
        event.record(stream)
        return event


class _Outcome(NamedTuple):
    """What an op's thread queued: the event after all of it, and why it stopped short if it did."""

    last: Event | None
    failure: Exception | None


class _Landing:
    """A load's per-layer events as its thread records them, for the forward pass to wait on."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._settled = False
        self._end: Event | None = None        # a failed load's event after all it queued
        self._changed = threading.Condition()

    @property
    def last(self) -> Event:
        return self._events[-1]

    def record(self, landed: Event) -> None:
        with self._changed:
            self._events.append(landed)
            self._changed.notify_all()

    def settle(self, issued: Future) -> None:
        """Once the thread is done: a failure wakes the waiters (its later layers will never be
        recorded), leaving them the event after what it did queue, if any."""
        failed = issued.exception() is not None or issued.result().failure is not None
        if failed:
            with self._changed:
                self._settled = True
                self._end = None if issued.exception() is not None else issued.result().last
                self._changed.notify_all()

    def peek(self, layer: int) -> Event | None:
        """The layer's event if recorded yet, never waiting."""
        return self._events[layer] if layer < len(self._events) else None

    def recorded(self, layer: int, timeout_s: float) -> Event | None:
        """The layer's event once recorded; if the load failed before it was, the event after
        every copy it queued (None if it queued none)."""
        if layer < len(self._events):
            return self._events[layer]
        with self._changed:
            if not self._changed.wait_for(lambda: layer < len(self._events) or self._settled, timeout_s):
                raise CopyFailed(f"load: layer {layer}'s copies were not issued within {timeout_s} s")
            return self._events[layer] if layer < len(self._events) else self._end


class _Issued(CompletionEvent):
    """A device op: done once its thread is done and the event after all it queued passed;
    failed if its thread raised or stopped short, or the device reports an error."""

    def __init__(self, issued: Future, what: str) -> None:
        self._issued, self.what = issued, what

    def query(self) -> bool:
        if not self._issued.done():
            return False
        if self.error is not None:
            return True
        try:
            outcome = self._issued.result()
            if outcome.last is not None and not outcome.last.query():
                return False
            failure = outcome.failure
        except Exception as exc:    # noqa: BLE001 - the thread's, or an asynchronous device error the query raised
            failure = exc
        if failure is None:
            return True
        self.error = CopyFailed(f"{self.what} failed: {type(failure).__name__}: {failure}")
        return True


class _LayerLanded(CompletionEvent):
    """One layer of a load, polled from the CPU: done once the event recorded after its copies
    passed; where the load failed before recording it, done with the load."""

    def __init__(self, landing: _Landing, layer: int, load: _Issued) -> None:
        self._landing, self._layer, self._load = landing, layer, load

    def query(self) -> bool:
        landed = self._landing.peek(self._layer)
        if landed is None:
            if not self._load.query():
                return False
            landed = self._landing.peek(self._layer)    # recorded before the load settled
            if landed is None:
                self.error = self._load.error
                return True
        try:
            return landed.query()
        except Exception as exc:    # noqa: BLE001 - an asynchronous device error the query raised
            self.error = CopyFailed(f"{self._load.what}, layer {self._layer}: {type(exc).__name__}: {exc}")
            return True


def done() -> HostEvent:
    """An event already complete: nothing to copy."""
    event = HostEvent()
    event.set()
    return event


def _failed(why: str) -> HostEvent:
    refused = HostEvent()
    refused.fail(CopyFailed(why))
    return refused
