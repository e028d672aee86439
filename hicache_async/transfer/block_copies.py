"""Moves an engine's per-layer KV blocks to and from host pool pages, a few kernels a layer.

vLLM registers each layer as a logical [blocks, heads, tokens, content] view over whatever
physical order its backend uses, and a host page holds one block of every layer in that
logical order. A layer's blocks are viewed as (blocks, runs..., run): each block as the runs
its bytes lie in, strided over the engine's memory, against the same shape over the host
pool. One `IndexPlan` (the Copier's index kernels) then moves a layer of a step's blocks in
one gather or scatter, or a gather and a scatter through a stage, whatever the block count:
per-block copies would cost a launch per block and layer, and a transpose where the orders
differ.

On CUDA the pinned pool is mapped into the device's address space and every copy queues on
one copy stream behind the compute stream's work so far, so it sees what the forward pass
wrote. A load's layers each complete on an event the forward pass waits on only when that
layer's attention asks. A save records where the compute stream is and returns: a few
launches a layer are still about a millisecond of CPU, which the step must not wait for, so
a thread of its own queues them behind that point, in order; a load first lets the saves
handed over before it be queued, so the stream puts a slot's save before a later load of it.
On CPU, where one set of cores does both, a load's layer is copied when its attention asks
and a save copies at once.

A block must be at most a run per head (each head's tokens and content back to back, as in
vLLM's LBHNC or LHBNC layouts). A token-major block (LBNHC, "NHD") is a run per token and
head, which the kernels would transpose a few hundred bytes at a time: refused at start-up.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ..errors import UsageError
from ..events import CompletionEvent, CudaEvent, HostEvent
from ..pools import HostPool
from .copier import CopyFailed, mapped
from .index_plan import WORDS, IndexPlan

# The most one layer stages at once: a layer of up to 1,024 blocks of 64 KiB is one gather
# and one scatter; beyond that, one more pair of launches per 64 MiB.
_STAGE_BYTES = 64 << 20

Runs = tuple[tuple[int, ...], tuple[int, ...], int]     # outer sizes, their strides, elements a run


class BlockCopies:
    """vLLM's per-layer KV block tensors <-> host pool pages (HostPool: tensor[page, layer] is
    one block of that layer in vLLM's logical [heads, tokens, content] order)."""

    def __init__(self, kv: list[torch.Tensor], host: HostPool) -> None:
        """`kv`: per layer, the logical [blocks, heads, tokens, content] view, any strides."""
        if not kv:
            raise UsageError("no KV cache layers to copy")
        pool = host.tensor
        if pool.dim() != 5 or pool.shape[1] != len(kv) or pool.shape[2:] != kv[0].shape[1:] \
                or pool.dtype != kv[0].dtype:
            raise UsageError(f"host pool is {tuple(pool.shape)} {pool.dtype}, the KV cache {len(kv)} layers of "
                             f"{tuple(kv[0].shape)} {kv[0].dtype}: expected (pages, {len(kv)}, "
                             f"{', '.join(map(str, kv[0].shape[1:]))})")
        self.host, self.layers = host, len(kv)
        self.cuda = kv[0].is_cuda
        self.num_blocks = kv[0].shape[0]
        if any(t.shape != kv[0].shape or t.dtype != kv[0].dtype for t in kv):
            raise UsageError(f"KV cache layers differ: {sorted({(tuple(t.shape), str(t.dtype)) for t in kv})}")
        runs = [_runs(layer, t) for layer, t in enumerate(kv)]
        if len({(sizes, run) for sizes, _, run in runs}) > 1:
            raise UsageError(f"KV cache layers lie in different runs: {sorted({r[::2] for r in runs})}")
        sizes, _, run = runs[0]
        pages = mapped(pool, kv[0].device) if self.cuda else pool
        views = [(_strided(t, r), pages[:, layer].view(pages.shape[0], *sizes, run))
                 for layer, (t, r) in enumerate(zip(kv, runs))]
        word = next(w for w in WORDS if all(_fits(v, w) for pair in views for v in pair))
        self._kv = [block.view(word) for block, _ in views]          # per layer: (blocks, runs..., words)
        self._pages = [page.view(word) for _, page in views]         # per layer: (pages, runs..., words)
        self._pending: list[int] = []         # layers of the current loads the forward pass has not waited on
        self._plan: IndexPlan | None = None   # CPU: the current loads, copied a layer at a time
        self._loaded = _done()                # CPU: set once every layer of the current loads landed
        self._issuing: Future | None = None   # CUDA: the last save handed to the issuing thread
        if self.cuda:
            self._stream = torch.cuda.Stream(device=kv[0].device)
            self._landed = [torch.cuda.Event() for _ in kv]     # re-recorded by each load
            self._issuer = ThreadPoolExecutor(1, thread_name_prefix="hicache-save")    # in order: one stream

    def load(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        """Host pages -> blocks, every layer. CUDA: queued on the copy stream, an event per layer,
        returns one done with the last; CPU: each layer is copied when `wait_layer` asks."""
        self.wait_loads()
        self._check(slots, blocks, written="block")
        if not slots:
            return _done()
        self._pending = list(range(self.layers))
        if not self.cuda:
            self._plan = IndexPlan.of(slots, blocks, self._kv[0], _STAGE_BYTES)
            self._loaded = HostEvent()
            return self._loaded
        if self._issuing is not None:       # earlier saves go first on the copy stream: they may write a slot read here
            wait([self._issuing])
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))   # kernels still reading the blocks
        with torch.cuda.stream(self._stream):
            plan = IndexPlan.of(slots, blocks, self._kv[0], _STAGE_BYTES)
            for layer, landed in enumerate(self._landed):
                plan.move(self._pages[layer], self._kv[layer])
                landed.record(self._stream)
        return CudaEvent(self._stream)

    def wait_layer(self, layer: int) -> None:
        """Before the layer's attention: CUDA, the compute stream waits on its loads; CPU, they
        are copied now."""
        if layer not in self._pending:
            return
        if self.cuda:
            torch.cuda.current_stream(self._stream.device).wait_event(self._landed[layer])
        else:
            self._plan.move(self._pages[layer], self._kv[layer])
        self._pending.remove(layer)
        if not self._pending and not self.cuda:
            self._plan = None
            self._loaded.set()

    def wait_loads(self) -> None:
        """Every layer of the current loads landed, those the forward pass never asked for
        included (on CUDA the last layer's event covers them all: one stream)."""
        if self.cuda and self._pending:
            self._pending = [max(self._pending)]
        for layer in list(self._pending):
            self.wait_layer(layer)

    def save(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        """Blocks -> host pages, every layer; a reader of the slots waits for the event. CUDA:
        records where the compute stream is and returns, the copies queued behind it by the
        issuing thread; CPU: copied on return."""
        self._check(slots, blocks, written="host slot")
        if not slots:
            return _done()
        if not self.cuda:
            self.wait_loads()       # a block loaded this step may be saved: its bytes first
            self._save(slots, blocks)
            return _done()
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self._stream.device))    # the blocks as the forward pass left them
        self._issuing = self._issuer.submit(self._issue_save, written, list(slots), list(blocks))
        return _Issued(self._issuing, len(slots))

    def _save(self, slots: list[int], blocks: list[int]) -> None:
        plan = IndexPlan.of(blocks, slots, self._kv[0], _STAGE_BYTES)
        for layer in range(self.layers):
            plan.move(self._kv[layer], self._pages[layer])

    def _issue_save(self, written: torch.cuda.Event, slots: list[int], blocks: list[int]) -> CudaEvent:
        """The issuing thread: the save's copies on the copy stream, behind `written`."""
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(written)
            self._save(slots, blocks)
            return CudaEvent(self._stream)

    def _check(self, slots: list[int], blocks: list[int], written: str) -> None:
        """Pairs of in-range indices, those `written` each at most once: a repeated index write
        is undefined in the kernels (a repeated read is fine: two requests may load one page),
        and an index past the end is a device fault."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} host slots for {len(blocks)} blocks")
        sides = (("host slot", slots, self.host.tensor.shape[0]), ("block", blocks, self.num_blocks))
        for name, indices, count in sides:
            if indices and not 0 <= min(indices) <= max(indices) < count:
                raise IndexError(f"{name}s {min(indices)}..{max(indices)} outside 0..{count - 1}")
            if name == written and len(set(indices)) != len(indices):
                repeated = sorted({i for i in indices if indices.count(i) > 1})
                raise AssertionError(f"{name} {repeated[0]} appears more than once in one copy")


def _runs(layer: int, t: torch.Tensor) -> Runs:
    """A block of the layer as runs of elements: the sizes and strides of the axes outside a run,
    and a run's length. Refuses a block of more runs than heads."""
    dims: list[list[int]] = []
    for n, step in reversed([d for d in zip(t.shape[1:], t.stride()[1:]) if d[0] != 1]):
        if dims and dims[-1][0] * dims[-1][1] == step:     # lies right after the axis inside it
            dims[-1][0] *= n
        else:
            dims.append([n, step])
    run = dims.pop(0)[0] if dims and dims[0][1] == 1 else 1
    outer = dims[::-1]
    count = math.prod(n for n, _ in outer)
    if count > max(1, t.shape[1]):
        raise UsageError(f"KV cache layer {layer} is {tuple(t.shape)} with strides {t.stride()}: a block is "
                         f"{count} runs of {run * t.element_size()} bytes, more than one a head; the "
                         f"connector needs each head's tokens back to back (vLLM's LBHNC layout)")
    return tuple(n for n, _ in outer), tuple(s for _, s in outer), run


def _strided(t: torch.Tensor, runs: Runs) -> torch.Tensor:
    """A layer's blocks as (blocks, runs..., run) over the same memory."""
    sizes, strides, run = runs
    return t.as_strided((t.shape[0], *sizes, run), (t.stride(0), *strides, 1))


def _fits(t: torch.Tensor, word: torch.dtype) -> bool:
    """Whether `t` can be viewed as `word`s: every run, step and its start a whole number of them."""
    size = t.element_size()
    steps = (*t.stride()[:-1], t.shape[-1], t.storage_offset())
    return all(n * size % word.itemsize == 0 for n in steps) and t.data_ptr() % word.itemsize == 0


def _done() -> HostEvent:
    done = HostEvent()
    done.set()
    return done


class _Issued(CompletionEvent):
    """A CUDA save: done once the issuing thread has queued its copies and they have run."""

    def __init__(self, issuing: Future, blocks: int) -> None:
        self._issuing, self._blocks = issuing, blocks

    def query(self) -> bool:
        if not self._issuing.done():
            return False
        failure = self._issuing.exception()
        if failure is not None:
            self.error = CopyFailed(f"save of {self._blocks} blocks failed: {type(failure).__name__}: {failure}")
            return True
        return self._issuing.result().query()
