"""Per-layer KV block tensors over one byte buffer, and the byte-exact round trip of a save and a
load through BlockCopies against plain per-block copies."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hicache_async.layout import KVLayout
from hicache_async.pools import HostPool
from hicache_async.transfer.block_copies import BlockCopies

Layers = Callable[[torch.Tensor], list[torch.Tensor]]      # the per-layer views over a byte buffer


class Copies(Protocol):
    """What a round trip drives: BlockCopies, or a test's executor of its DMA plan."""

    def save(self, slots: list[int], blocks: list[int]): ...
    def load(self, slots: list[int], blocks: list[int]): ...
    def wait_loads(self) -> None: ...
    def close(self) -> None: ...

LAYERS, BLOCKS, TOKENS = 3, 12, 4
# vLLM's KVCacheLayout members: the physical order of the logical [layer, block, head, token, content] axes.
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
# (heads, content): K and V packed in content; K and V heads split (vLLM's NVFP4 groups); an MLA latent.
CONTENTS = {"packed": (2, 16), "split": (4, 8), "mla": (1, 12)}
TOKEN_MAJOR = {"LBNHC", "BLNHC"}     # a block is a run per token and head: refused where there are heads


@dataclass
class Blocks:
    """Per-layer logical [blocks, heads, tokens, content] bf16 views over one byte buffer, the
    axes laid out in `order`, each block's page followed by `pad` spare elements (vLLM pads
    pages to a common size)."""

    order: tuple[int, ...]
    heads: int
    content: int
    pad: int = 0

    def __post_init__(self) -> None:
        self.shape = (LAYERS, BLOCKS, self.heads, TOKENS, self.content)
        self.strides = [0] * 5
        step = 1
        for axis in reversed(self.order):
            step += self.pad if axis == 1 else 0
            self.strides[axis] = step
            step *= self.shape[axis]
        self.raw = random_bytes(2 * step, seed=1)

    def layers(self, raw: torch.Tensor | None = None) -> list[torch.Tensor]:
        raw = self.raw if raw is None else raw
        return list(raw.view(torch.bfloat16).as_strided(self.shape, self.strides).unbind(0))

    def host(self) -> HostPool:
        return host_pool(self.layers(), 2 * BLOCKS)


def movable_layouts() -> dict[str, Blocks]:
    """Every order and content BlockCopies moves, and two orders with padded pages."""
    cases = {f"{name}-{content}": Blocks(order, heads, width)
             for name, order in ORDERS.items() for content, (heads, width) in CONTENTS.items()
             if name not in TOKEN_MAJOR or heads == 1}
    return cases | {f"{name}-packed-padded": Blocks(ORDERS[name], 2, 16, pad=3) for name in ("LBHNC", "BLHNC")}


def host_pool(kv: list[torch.Tensor], slots: int, chunk_bytes: int | None = None) -> HostPool:
    """A host pool of random bits whose pages hold one block of each layer of `kv`, registered
    (on CUDA) `chunk_bytes` at a time."""
    _, heads, tokens, content = kv[0].shape
    layout = KVLayout(num_layers=len(kv), kv_heads=heads, head_dim=content, page_size=tokens, dtype=kv[0].dtype,
                      axes=("head", "token", "dim"))
    host = HostPool(layout, slots, chunk_bytes=chunk_bytes)
    host.tensor.view(torch.uint8).copy_(random_bytes(host.tensor.numel() * host.tensor.element_size(), seed=2)
                                        .view(host.tensor.view(torch.uint8).shape))
    return host


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integers: every bit pattern compares, NaNs included."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_round_trip(raw: torch.Tensor, layers: Layers, slots: list[int], blocks: list[int],
                      targets: list[int], copies_of: Callable[[list[torch.Tensor], HostPool], Copies] = BlockCopies,
                      chunk_bytes: int | None = None) -> None:
    """Save `blocks` to `slots`, then load the slots into `targets`, through `copies_of(kv, host)`
    over a host pool registered `chunk_bytes` at a time: every byte of the host pool and of `raw`
    (other blocks and padding included) must be what plain per-block copies give."""
    kv = layers(raw)
    host = host_pool(kv, 2 * kv[0].shape[0], chunk_bytes)
    copies = copies_of(kv, host)
    try:
        _round_trip(raw, layers, kv, host, copies, slots, blocks, targets)
    finally:
        copies.close()
        host.close()


def _round_trip(raw: torch.Tensor, layers: Layers, kv: list[torch.Tensor], host: HostPool, copies: Copies,
                slots: list[int], blocks: list[int], targets: list[int]) -> None:
    expected = host.tensor.clone()
    for s, b in zip(slots, blocks):
        for layer, t in enumerate(kv):
            bits(expected[s, layer]).copy_(bits(t[b]))
    saved = copies.save(slots, blocks)
    asyncio.run(saved.wait(30, "save"))
    assert saved.error is None and torch.equal(bits(host.tensor), bits(expected))

    reference = raw.clone()
    for s, t in zip(slots, targets):
        for layer, view in enumerate(layers(reference)):
            bits(view[t]).copy_(bits(host.tensor[s, layer]).to(view.device))
    loaded = copies.load(slots, targets)
    copies.wait_loads()
    if raw.is_cuda:
        torch.cuda.synchronize()
    assert loaded.query() and loaded.error is None and torch.equal(raw, reference)
