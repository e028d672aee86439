"""BlockCopies on CUDA: every byte on the copy engines, loads and saves on a stream each.

The SMs belong to the forward pass: an index kernel moving KV through the mapped pool slowed
a neighbouring matmul by 15-20 %, a DMA slows it by nothing. Each direction has a copy engine
of its own, so loads and saves get a stream each and overlap. A batch of thousands of
descriptors costs the driver milliseconds of CPU, so `load()` and `save()` only record where
the compute stream is and hand the copy to a thread of their direction (the driver call lets
go of the GIL); the threads issue in the order they were handed ops. A load issues a batch
and records an event a layer; `wait_layer` waits on the CPU, bounded, until that layer's
event is recorded, then makes the compute stream wait on it: nothing waits on an event not
yet recorded. A save is one batch over every layer.

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

No copy is issued while the caller's stream captures a CUDA graph (the batch call is refused
there): such a load or save completes at once, failed.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ..errors import UsageError
from ..events import CompletionEvent, HostEvent
from ..pools import HostPool
from .copier import CopyFailed
from .dma import CudaDma
from .dma_plan import DmaPlan

ISSUE_TIMEOUT_S = 30.0      # the most `wait_layer` waits for a layer's copies to be issued


class StreamCopies:
    """DMA between a device's per-layer KV blocks and a pinned host pool (see the module)."""

    def __init__(self, plan: DmaPlan, host: HostPool, device: torch.device, layers: int) -> None:
        if not host.tensor.is_pinned():
            raise UsageError("the host pool must be pinned for device copies: create it after the rank's CUDA "
                             "device is set")
        self.plan, self.layers = plan, layers
        self.dma = CudaDma(device)
        self.dma.check_host_pointers()
        self.device = torch.device("cuda", self.dma.index)
        self._streams = {kind: torch.cuda.Stream(device=self.device) for kind in ("load", "save")}
        self._threads = {kind: ThreadPoolExecutor(1, thread_name_prefix=f"hicache-{kind}", initializer=self.dma.bind)
                         for kind in ("load", "save")}
        self._landing: _Landing | None = None     # the current loads' layers, as the load thread records them
        self._pending: list[int] = []             # their layers the compute stream has not waited on
        self._saving: Future | None = None        # the last save handed to the save thread
        self._saved: torch.cuda.Event | None = None   # the last save's event its thread recorded
        self._closed = False

    def load(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        """After the current loads (for the compute stream)."""
        what = f"load of {len(slots)} blocks"
        refused = self._refused(what)
        if refused is not None:
            return refused
        if not slots:
            return done()
        landing = _Landing()
        self._landing, self._pending = landing, list(range(self.layers))
        issued = self._hand_over("load", self._issue_load, landing, list(slots), list(blocks))
        issued.add_done_callback(landing.settle)
        return _Issued(issued, what)

    def save(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        what = f"save of {len(slots)} blocks"
        refused = self._refused(what)       # a block loaded this step may be saved: it goes behind its layers
        if refused is not None:
            return refused
        self._saving = self._hand_over("save", self._issue_save, list(slots), list(blocks))
        return _Issued(self._saving, what)

    def wait_layer(self, layer: int) -> None:
        """Nothing while a graph is captured: its recorded wait would outlive this load."""
        if layer not in self._pending or torch.cuda.is_current_stream_capturing():
            return
        landed = self._landing.recorded(layer, ISSUE_TIMEOUT_S)
        if landed is not None:
            torch.cuda.current_stream(self.device).wait_event(landed)
        self._pending.remove(layer)

    def wait_loads(self) -> None:
        """The last layer's event covers the others: one stream, in order."""
        if self._pending:
            self._pending = [max(self._pending)]
            self.wait_layer(self._pending[0])

    def fence_saves(self, timeout_s: float) -> None:
        """The compute stream waits for every save handed over so far; the CPU waits only until
        their copies are issued, at most `timeout_s`."""
        if self._saving is None or torch.cuda.is_current_stream_capturing():
            return
        if not wait([self._saving], timeout=timeout_s).done:
            raise CopyFailed(f"fence_saves: the saves handed over were not issued within {timeout_s} s")
        if self._saved is not None:
            torch.cuda.current_stream(self.device).wait_event(self._saved)

    def close(self) -> None:
        """Issues what was handed over, stops the threads, and waits for both streams."""
        if self._closed:
            return
        self._closed = True
        for thread in self._threads.values():
            thread.shutdown(wait=True)
        for stream in self._streams.values():
            stream.synchronize()

    def _refused(self, what: str) -> HostEvent | None:
        """None once the compute stream waits on the current loads; a failed event instead
        while a graph is captured or if their copies were never issued."""
        if torch.cuda.is_current_stream_capturing():
            return _failed(f"{what} refused: a CUDA graph is being captured")
        try:
            self.wait_loads()
        except CopyFailed as exc:
            return _failed(f"{what} refused: {exc}")
        return None

    def _hand_over(self, kind: str, issue, *args) -> Future:
        """The op to its direction's thread, behind the compute stream's work so far; a refused
        hand-over (closed, or a thread that could not start) is a failed future."""
        after = torch.cuda.Event()
        after.record(torch.cuda.current_stream(self.device))
        try:
            return self._threads[kind].submit(issue, after, *args)
        except RuntimeError as exc:
            refused: Future = Future()
            refused.set_exception(exc)
            return refused

    def _issue_load(self, after: torch.cuda.Event, landing: _Landing, slots: list[int],
                    blocks: list[int]) -> torch.cuda.Event:
        """The load thread: a batch and an event a layer."""
        stream = self._streams["load"]
        stream.wait_event(after)
        for copy in self.plan.layers(slots, blocks, load=True):
            self.dma.copy(copy, stream)
            landed = torch.cuda.Event()
            landed.record(stream)
            landing.record(landed)
        return landed

    def _issue_save(self, after: torch.cuda.Event, slots: list[int], blocks: list[int]) -> torch.cuda.Event:
        """The save thread: one batch over every layer, behind the blocks as the forward pass left them."""
        stream = self._streams["save"]
        stream.wait_event(after)
        self.dma.copy(self.plan.whole(slots, blocks, load=False), stream)
        saved = torch.cuda.Event()
        saved.record(stream)
        self._saved = saved
        return saved


class _Landing:
    """A load's per-layer events as its thread records them, for the forward pass to wait on."""

    def __init__(self) -> None:
        self._events: list[torch.cuda.Event] = []
        self._failed = False
        self._changed = threading.Condition()

    def record(self, landed: torch.cuda.Event) -> None:
        with self._changed:
            self._events.append(landed)
            self._changed.notify_all()

    def settle(self, issued: Future) -> None:
        """Once the thread is done: a failure wakes the waiters (its layers will never be recorded)."""
        if issued.exception() is not None:
            with self._changed:
                self._failed = True
                self._changed.notify_all()

    def recorded(self, layer: int, timeout_s: float) -> torch.cuda.Event | None:
        """The layer's event once recorded; None if the load failed before it was."""
        if layer < len(self._events):
            return self._events[layer]
        with self._changed:
            if not self._changed.wait_for(lambda: layer < len(self._events) or self._failed, timeout_s):
                raise CopyFailed(f"load: layer {layer}'s copies were not issued within {timeout_s} s")
            return self._events[layer] if layer < len(self._events) else None


class _Issued(CompletionEvent):
    """A CUDA op: done once its thread has issued its copies and its last event has passed;
    failed if the thread raised or the device reports an error."""

    def __init__(self, issued: Future, what: str) -> None:
        self._issued, self._what = issued, what

    def query(self) -> bool:
        if not self._issued.done():
            return False
        if self.error is not None:
            return True
        failure = self._issued.exception()
        try:
            if failure is None:
                return self._issued.result().query()
        except RuntimeError as exc:         # an asynchronous CUDA error, raised by the query
            failure = exc
        self.error = CopyFailed(f"{self._what} failed: {type(failure).__name__}: {failure}")
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
