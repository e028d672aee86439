"""Copies between vLLM's KV blocks and the host pool, one layer at a time.

A host page holds one block of every layer in vLLM's logical order, so a copy is block to
page, layer by layer, with no layout of ours in between. Loads follow the forward pass: on a
GPU every layer's copies are queued at once on a copy stream, each layer behind an event the
compute stream waits on when its attention asks (`wait_layer`), so layer 0 computes while
later layers still copy; on a CPU, where one set of cores does both, a layer is copied when
its attention asks, so the forward pass starts without waiting for the rest.
"""
from __future__ import annotations

import torch

from hicache_async.pools import HostPool

from .plan import Move


class LayerCopies:
    def __init__(self, kv: list[torch.Tensor], host: HostPool) -> None:
        self.kv, self.host = kv, host
        self.cuda = kv[0].is_cuda
        self.stream = torch.cuda.Stream(device=kv[0].device) if self.cuda else None
        self._loads: list[Move] = []
        self._index = _indices([])     # the loads' host slots and blocks
        self._pending: list = []        # per layer: a CUDA event, or True while the CPU copy waits

    def load(self, moves: list[Move]) -> None:
        self._loads = [m for m in moves if m.slots]
        self._index = _indices(self._loads)
        if not self._loads:
            self._pending = []
            return
        if not self.cuda:
            self._pending = [True] * len(self.kv)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.kv[0].device))
        self._pending = []
        with torch.cuda.stream(self.stream):
            for layer in range(len(self.kv)):
                self._load_layer(layer)
                event = torch.cuda.Event()
                event.record(self.stream)
                self._pending.append(event)

    def wait_layer(self, layer: int) -> None:
        if layer >= len(self._pending) or self._pending[layer] is None:
            return
        if self.cuda:
            torch.cuda.current_stream(self.kv[0].device).wait_event(self._pending[layer])
        else:
            self._load_layer(layer)
        self._pending[layer] = None

    def wait_all(self) -> None:
        """Every load done (a layer the forward pass never asked for included)."""
        for layer in range(len(self._pending)):
            self.wait_layer(layer)
        self._pending = []

    def save(self, moves: list[Move]) -> None:
        """Blocks to host pages, every layer; done (synchronised) on return, since a backup
        may read the pages next."""
        if not any(m.slots for m in moves):
            return
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.kv[0].device))
        slots, blocks = _indices(moves)
        if not self.cuda:       # one gather and one scatter a layer
            for layer, kv in enumerate(self.kv):
                self.host.tensor[slots, layer] = kv[blocks]
            return
        with torch.cuda.stream(self.stream):
            for layer, kv in enumerate(self.kv):
                for slot, block in zip(slots.tolist(), blocks.tolist()):
                    self.host.tensor[slot, layer].copy_(kv[block], non_blocking=True)
        self.stream.synchronize()

    def _load_layer(self, layer: int) -> None:
        kv, (slots, blocks) = self.kv[layer], self._index
        if not self.cuda:
            kv[blocks] = self.host.tensor[slots, layer]
            return
        for slot, block in zip(slots.tolist(), blocks.tolist()):   # pinned pages, each its own async copy
            kv[block].copy_(self.host.tensor[slot, layer], non_blocking=True)


def _indices(moves: list[Move]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every move's host slots and vLLM blocks, as index tensors."""
    slots = [s for m in moves for s in m.slots]
    blocks = [b for m in moves for b in m.blocks]
    return torch.tensor(slots, dtype=torch.long), torch.tensor(blocks, dtype=torch.long)

