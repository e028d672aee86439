"""Moves an engine's per-layer KV blocks to and from host pool pages.

vLLM registers each layer as a logical [blocks, heads, tokens, content] view over whatever
physical order its backend uses, and a host page holds one block of every layer in that
logical order. A layer's blocks are viewed as (blocks, runs..., run): each block as the runs
its bytes lie in (`block_runs`), strided over the engine's memory, against the same shape
over the host pool.

On a device every byte moves by DMA on the copy engines (`StreamCopies`: a load and a save
stream, the batches issued by a thread of each direction, a load landing a layer at a time;
its module says what orders the two streams): the KV's CUDA device, or a device given, such as
the simulated one (`sim_device`) that runs the same code over CPU tensors. On CPU, where one
set of cores does both, the
index kernels (`IndexPlan`) move a layer of a step's blocks in one gather or scatter, or a
gather and a scatter through a stage, whatever the block count: a load's layer is copied
when its attention asks, a save at once.

A block must be at most a run per head (each head's tokens and content back to back, as in
vLLM's LBHNC or LHBNC layouts). A token-major block (LBNHC, "NHD") is a run per token and
head, a few hundred bytes a copy: refused at start-up.
"""
from __future__ import annotations

import torch

from ..errors import UsageError
from ..events import CompletionEvent, HostEvent
from ..pools import HostPool
from .device import CudaDevice, Device
from .dma_plan import DmaPlan, Runs, block_runs
from .index_plan import WORDS, IndexPlan
from .stream_copies import StreamCopies, done

# The most one layer stages at once on CPU: a layer of up to 1,024 blocks of 64 KiB is one
# gather and one scatter; beyond that, one more pair per 64 MiB.
_STAGE_BYTES = 64 << 20


class BlockCopies:
    """vLLM's per-layer KV block tensors <-> host pool pages (HostPool: tensor[page, layer] is
    one block of that layer in vLLM's logical [heads, tokens, content] order).

    `load` and `save` return an event; a failed copy (a thread raised, a device error, a CUDA
    graph being captured) completes it with `error` set and never raises."""

    def __init__(self, kv: list[torch.Tensor], host: HostPool, device: Device | None = None) -> None:
        """`kv`: per layer, the logical [blocks, heads, tokens, content] view, any strides;
        `device`: the copy engines' (owned from here on), by default the KV's CUDA device, and
        none (the CPU kernels) for KV on the CPU."""
        if not kv:
            raise UsageError("no KV cache layers to copy")
        pool = host.tensor
        if pool.dim() != 5 or pool.shape[1] != len(kv) or pool.shape[2:] != kv[0].shape[1:] \
                or pool.dtype != kv[0].dtype:
            raise UsageError(f"host pool is {tuple(pool.shape)} {pool.dtype}, the KV cache {len(kv)} layers of "
                             f"{tuple(kv[0].shape)} {kv[0].dtype}: expected (pages, {len(kv)}, "
                             f"{', '.join(map(str, kv[0].shape[1:]))})")
        self.host, self.layers = host, len(kv)
        if device is None and kv[0].is_cuda:
            device = CudaDevice(kv[0].device)
        self.streamed = device is not None
        """Whether copies run on a device's streams (landing later than issued)."""
        self.num_blocks = kv[0].shape[0]
        if any(t.shape != kv[0].shape or t.dtype != kv[0].dtype for t in kv):
            raise UsageError(f"KV cache layers differ: {sorted({(tuple(t.shape), str(t.dtype)) for t in kv})}")
        runs = [block_runs(layer, t) for layer, t in enumerate(kv)]
        if len({(sizes, run) for sizes, _, run in runs}) > 1:
            raise UsageError(f"KV cache layers lie in different runs: {sorted({r[::2] for r in runs})}")
        if device is not None:
            self._streams = StreamCopies(DmaPlan(kv, runs, host), host, device, len(kv))
            return
        sizes, _, run = runs[0]
        views = [(_strided(t, r), pool[:, layer].view(pool.shape[0], *sizes, run))
                 for layer, (t, r) in enumerate(zip(kv, runs))]
        word = next(w for w in WORDS if all(_fits(v, w) for pair in views for v in pair))
        self._kv = [block.view(word) for block, _ in views]          # per layer: (blocks, runs..., words)
        self._pages = [page.view(word) for _, page in views]         # per layer: (pages, runs..., words)
        self._pending: list[int] = []         # layers of the current loads not yet copied
        self._plan: IndexPlan | None = None   # the current loads, copied a layer at a time
        self._loaded = done()                # set once every layer of the current loads landed

    def load(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        """Host pages -> blocks, every layer, after the current loads. Device: handed to the load
        thread, an event a layer; CPU: each layer is copied when `wait_layer` asks. The event
        is done with the last layer."""
        self._check(slots, blocks, written="block")
        if self.streamed:
            return self._streams.load(slots, blocks)
        self.wait_loads()
        if not slots:
            return done()
        self._pending = list(range(self.layers))
        self._plan = IndexPlan.of(slots, blocks, self._kv[0], _STAGE_BYTES)
        self._loaded = HostEvent()
        return self._loaded

    def wait_layer(self, layer: int) -> None:
        """Before the layer's attention: device, the compute stream waits on its loads (once the
        load thread has issued them, at most `stream_copies.ISSUE_TIMEOUT_S`); CPU, they are
        copied now."""
        if self.streamed:
            self._streams.wait_layer(layer)
            return
        if layer not in self._pending:
            return
        self._plan.move(self._pages[layer], self._kv[layer])
        self._pending.remove(layer)
        if not self._pending:
            self._plan = None
            self._loaded.set()

    def wait_loads(self) -> None:
        """Every layer of the current loads landed (device: for the compute stream), those the
        forward pass never asked for included."""
        if self.streamed:
            self._streams.wait_loads()
            return
        for layer in list(self._pending):
            self.wait_layer(layer)

    def save(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        """Blocks -> host pages, every layer, behind the current loads; a reader of the slots
        waits for the event. Device: records where the compute stream is and returns, the copies
        issued behind it by the save thread; CPU: copied on return."""
        self._check(slots, blocks, written="host slot")
        if not slots:
            return done()
        if self.streamed:
            return self._streams.save(slots, blocks)
        self.wait_loads()       # a block loaded this step may be saved: its bytes first
        plan = IndexPlan.of(blocks, slots, self._kv[0], _STAGE_BYTES)
        for layer in range(self.layers):
            plan.move(self._kv[layer], self._pages[layer])
        return done()

    def fence_saves(self, timeout_s: float) -> None:
        """The compute stream waits for every save handed over so far (before a preempted
        request's blocks go to another): the CPU waits only until their copies are issued, at
        most `timeout_s`, then CopyFailed names the wait. CPU: nothing to wait for."""
        if self.streamed:
            self._streams.fence_saves(timeout_s)

    def close(self) -> None:
        """Finishes what was handed over (CPU: the current loads' layers), stops the copy
        threads and waits for both streams; once."""
        if self.streamed:
            self._streams.close()
        else:
            self.wait_loads()

    def _check(self, slots: list[int], blocks: list[int], written: str) -> None:
        """Pairs of in-range indices, those `written` each at most once: a repeated index write
        is undefined in the kernels and in a batch of DMAs (a repeated read is fine: two
        requests may load one page), and an index past the end is a device fault."""
        if len(slots) != len(blocks):
            raise ValueError(f"{len(slots)} host slots for {len(blocks)} blocks")
        sides = (("host slot", slots, self.host.tensor.shape[0]), ("block", blocks, self.num_blocks))
        for name, indices, count in sides:
            if indices and not 0 <= min(indices) <= max(indices) < count:
                raise IndexError(f"{name}s {min(indices)}..{max(indices)} outside 0..{count - 1}")
            if name == written and len(set(indices)) != len(indices):
                repeated = sorted({i for i in indices if indices.count(i) > 1})
                raise AssertionError(f"{name} {repeated[0]} appears more than once in one copy")


def _strided(t: torch.Tensor, runs: Runs) -> torch.Tensor:
    """A layer's blocks as (blocks, runs..., run) over the same memory."""
    sizes, strides, run = runs
    return t.as_strided((t.shape[0], *sizes, run), (t.stride(0), *strides, 1))


def _fits(t: torch.Tensor, word: torch.dtype) -> bool:
    """Whether `t` can be viewed as `word`s: every run, step and its start a whole number of them."""
    size = t.element_size()
    steps = (*t.stride()[:-1], t.shape[-1], t.storage_offset())
    return all(n * size % word.itemsize == 0 for n in steps) and t.data_ptr() % word.itemsize == 0
