"""GPU copy figures: a step's scattered KV blocks to and from the pinned host pool, through
BlockCopies (the vLLM connector's blocks) and through the core's Copier (its layer-major
device pool's pages), both DMA on the copy engines, beside a pinned contiguous copy of the same
bytes measured in the same run.

The shape is Llama-3-8B's: 32 layers, 8 KV heads, head 128, 16-token blocks, bf16, K and V
(64 KiB a block and layer, 2 MiB a block). Every figure is the best of a few repetitions, and
every byte moved is checked once they are done. Besides throughput:
- the CPU time to issue one step's loads, beside issuing them as one `copy_` per block and
  layer (what the connector did before), and the time `save()` takes to return, beside the
  time until its copies are done;
- the same calls with a save queued just before (the caller's thread must not wait for it),
  beside them alone;
- interference: a loop of bf16 matmuls timed by CUDA events on the compute stream beside a
  load or a save of 512 blocks (BlockCopies') or pages (the Copier's) issued just before it,
  beside the loop alone (copies on the SMs slow it, copies on the copy engines should not);
- a load and a save of 512 blocks issued together: both directions' bytes over the time both
  take, beside one direction's pinned contiguous rate (each direction has its copy engine).
CUDA only; torch, cuda-bindings and this package alone, so it runs on a bare GPU machine.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from ...errors import HiCacheError
from ...events import CompletionEvent
from ...layout import KVLayout
from ...pools import DevicePool, HostPool
from ...transfer.block_copies import BlockCopies
from ...transfer.copier import Copier
from .figure import figure

LAYERS, HEADS, TOKENS, HEAD_DIM, DTYPE = 32, 8, 16, 128, torch.bfloat16
COUNTS = (64, 512)
POOL = 2 * max(COUNTS)      # blocks and host pages to scatter a step's among
MATMUL, MATMULS = 8192, 40  # the compute the copies run beside: 40 bf16 matmuls of 8192 x 8192


def gpu_copy_figures(quick: bool) -> list[dict]:
    if not torch.cuda.is_available():
        print("gpu-copies: no CUDA device here; nothing measured")
        return []
    reps = 3 if quick else 10
    block_side, copier_side = _BlockSide(), _CopierSide()
    try:
        figures = [f for count in COUNTS for f in _figures(block_side, copier_side, count, reps)]
        steps = _Steps(max(COUNTS))
        return figures + _caller_cpu(block_side, steps, reps) + _beside_compute(block_side, copier_side, steps) \
            + _both_ways(block_side, steps, reps)
    finally:
        block_side.close()
        copier_side.close()


def _figures(blocks: _BlockSide, copier: _CopierSide, count: int, reps: int) -> list[dict]:
    rng = random.Random(count)
    slots, picked = rng.sample(range(POOL), count), rng.sample(range(POOL), 2 * count)
    moved, targets = picked[:count], picked[count:]         # a load lands in blocks other than the saved ones
    nbytes = count * LAYERS * blocks.layer_block_bytes
    d2h, h2d = _pinned_contiguous(nbytes, reps)
    save_done, save_return = _best(reps, lambda: blocks.save(slots, moved))
    load_done, load_issue = _best(reps, lambda: blocks.load(slots, targets))
    blocks.check(("save", slots, moved), ("load", slots, targets))
    write_done, _ = _best(reps, lambda: copier.write(moved, slots))
    copier_load_done, _ = _best(reps, lambda: copier.load(slots, targets))
    copier.check(slots, moved, targets)
    per_block = min(blocks.per_block_issue(slots, targets) for _ in range(min(reps, 3)))
    gb = nbytes / 1e9
    return [
        figure(f"gpu_block_save_gbps_{count}", gb / save_done, "GB/s", "pinned_d2h_gbps", gb / d2h),
        figure(f"gpu_block_load_gbps_{count}", gb / load_done, "GB/s", "pinned_h2d_gbps", gb / h2d),
        figure(f"gpu_copier_write_gbps_{count}", gb / write_done, "GB/s", "pinned_d2h_gbps", gb / d2h),
        figure(f"gpu_copier_load_gbps_{count}", gb / copier_load_done, "GB/s", "pinned_h2d_gbps", gb / h2d),
        figure(f"gpu_block_load_issue_ms_{count}", 1e3 * load_issue, "ms",
               "per_block_copy_issue_ms", 1e3 * per_block),
        figure(f"gpu_block_save_return_ms_{count}", 1e3 * save_return, "ms", "save_done_ms", 1e3 * save_done),
    ]


class _Steps:
    """Disjoint slots and blocks for a save and a load under way together: the scheduler never
    loads a slot a save is writing, nor a block one is reading."""

    def __init__(self, count: int) -> None:
        rng = random.Random(-count)
        slots, blocks = rng.sample(range(POOL), 2 * count), rng.sample(range(POOL), 2 * count)
        self.save = (slots[:count], blocks[:count])
        self.load = (slots[count:], blocks[count:])
        self.nbytes = count * LAYERS * _BlockSide.layer_block_bytes


def _caller_cpu(blocks: _BlockSide, steps: _Steps, reps: int) -> list[dict]:
    """Seconds on the caller's thread (wall time: a wait for the GIL counts) for `load()` and
    `save()` with a save queued just before, beside each alone."""
    def timed(call, queued: bool) -> float:
        torch.cuda.synchronize()
        before = blocks.copies.save(*steps.save) if queued else None
        start = time.perf_counter()
        done = call()
        spent = time.perf_counter() - start
        blocks.copies.wait_loads()
        for event in (before, done):
            _settle(event)
        return spent
    count = len(steps.save[0])
    figures = []
    for name, call in (("load", lambda: blocks.copies.load(*steps.load)),
                       ("save", lambda: blocks.copies.save(*steps.save))):
        alone = min(timed(call, queued=False) for _ in range(reps))
        queued = min(timed(call, queued=True) for _ in range(reps))
        figures.append(figure(f"gpu_block_{name}_cpu_ms_after_a_save_{count}", 1e3 * queued, "ms",
                              f"{name}_cpu_ms_alone", 1e3 * alone))
    return figures


def _beside_compute(blocks: _BlockSide, copier: _CopierSide, steps: _Steps) -> list[dict]:
    """The matmul loop's milliseconds (CUDA events on the compute stream, best of 3) beside a
    load and beside a save (a write, the Copier's) issued just before it, each beside the loop
    alone."""
    a, b = (torch.randn(MATMUL, MATMUL, dtype=DTYPE, device="cuda") for _ in range(2))
    out = torch.empty_like(a)

    def loop(issue=None) -> float:
        torch.cuda.synchronize()
        done = issue() if issue is not None else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MATMULS):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        blocks.copies.wait_loads()
        _settle(done)
        return start.elapsed_time(end)
    loop()      # cuBLAS's first call
    alone = min(loop() for _ in range(3))
    load = min(loop(lambda: blocks.copies.load(*steps.load)) for _ in range(3))
    save = min(loop(lambda: blocks.copies.save(*steps.save)) for _ in range(3))
    pages_load = min(loop(lambda: copier.load(*steps.load)) for _ in range(3))
    pages_write = min(loop(lambda: copier.write(*steps.save[::-1])) for _ in range(3))
    count = len(steps.save[0])
    return [figure(f"gpu_matmuls_beside_a_load_ms_{count}", load, "ms", "matmuls_alone_ms", alone),
            figure(f"gpu_matmuls_beside_a_save_ms_{count}", save, "ms", "matmuls_alone_ms", alone),
            figure(f"gpu_matmuls_beside_a_copier_load_ms_{count}", pages_load, "ms", "matmuls_alone_ms", alone),
            figure(f"gpu_matmuls_beside_a_copier_write_ms_{count}", pages_write, "ms", "matmuls_alone_ms", alone)]


def _both_ways(blocks: _BlockSide, steps: _Steps, reps: int) -> list[dict]:
    """A load and a save issued together: their bytes over the time both take, beside the
    faster direction's pinned contiguous rate."""
    d2h, h2d = _pinned_contiguous(steps.nbytes, reps)

    def both() -> CompletionEvent:
        saved = blocks.copies.save(*steps.save)
        blocks.copies.load(*steps.load)
        blocks.copies.wait_loads()
        return saved
    done, _ = _best(reps, both)
    blocks.check(("save", *steps.save), ("load", *steps.load))
    count = len(steps.save[0])
    return [figure(f"gpu_block_load_and_save_gbps_{count}", 2 * steps.nbytes / done / 1e9, "GB/s",
                   "pinned_one_way_gbps", steps.nbytes / min(d2h, h2d) / 1e9)]


def _settle(done: CompletionEvent | None) -> None:
    """Waits for `done` (its thread included); a failed copy fails the bench."""
    while done is not None and not done.query():
        time.sleep(0)       # lets the issuing thread run
    if done is not None and done.error is not None:
        raise HiCacheError(f"gpu-copies: {done.error}")


def _best(reps: int, issue: Callable[[], CompletionEvent | None]) -> tuple[float, float]:
    """The best of `reps` runs, each starting on an idle device: (seconds until the copies are
    done, seconds until `issue` returned). An event `issue` returns is waited on before the
    device: a save's copies are queued by a thread of its own."""
    runs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        done = issue()
        issued = time.perf_counter() - start
        _settle(done)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start, issued))
    return min(done for done, _ in runs), min(issued for _, issued in runs)


def _pinned_contiguous(nbytes: int, reps: int) -> tuple[float, float]:
    """Seconds for one device -> host and one host -> device copy of `nbytes` contiguous bytes."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
    d2h, _ = _best(reps, lambda: copy(host, device))
    h2d, _ = _best(reps, lambda: copy(device, host))
    return d2h, h2d


class _BlockSide:
    """vLLM-shaped blocks (per layer [blocks, heads, tokens, K|V]) and a host pool of the same pages."""

    layout = KVLayout(num_layers=LAYERS, kv_heads=HEADS, head_dim=2 * HEAD_DIM, page_size=TOKENS, dtype=DTYPE,
                      axes=("head", "token", "dim"))
    layer_block_bytes = layout.layer_page_bytes

    def __init__(self) -> None:
        self.kv = list(torch.randn((LAYERS, POOL, HEADS, TOKENS, 2 * HEAD_DIM), dtype=DTYPE, device="cuda").unbind(0))
        self.host = HostPool(self.layout, POOL)
        _random_pages(self.host)        # unlike every block
        self.copies = BlockCopies(self.kv, self.host)

    def save(self, slots: list[int], blocks: list[int]) -> CompletionEvent:
        return self.copies.save(slots, blocks)

    def load(self, slots: list[int], blocks: list[int]) -> None:
        self.copies.load(slots, blocks)
        self.copies.wait_loads()

    def check(self, *moves: tuple[str, list[int], list[int]]) -> None:
        """Each (name, slots, blocks) moved: the slots hold the blocks' bytes, every layer."""
        for name, slots, blocks in moves:
            pages = self.host.tensor[slots].to("cuda")
            for layer, kv in enumerate(self.kv):
                if not torch.equal(_bits(pages[:, layer]), _bits(kv[blocks])):
                    raise HiCacheError(f"gpu-copies: BlockCopies {name} of {len(slots)} blocks moved wrong bytes "
                                       f"in layer {layer}")

    def per_block_issue(self, slots: list[int], blocks: list[int]) -> float:
        """Seconds to issue the loads as one `copy_` per block and layer, on a copy stream."""
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for layer, kv in enumerate(self.kv):
                for slot, block in zip(slots, blocks):
                    kv[block].copy_(self.host.tensor[slot, layer], non_blocking=True)
        issued = time.perf_counter() - start
        torch.cuda.synchronize()
        return issued

    def close(self) -> None:
        self.copies.close()
        self.host.close()


class _CopierSide:
    """The core's layer-major device pool and a host pool, moved by the Copier."""

    def __init__(self) -> None:
        layout = KVLayout(num_layers=LAYERS, kv_heads=HEADS, head_dim=HEAD_DIM, page_size=TOKENS, dtype=DTYPE)
        self.device = DevicePool(layout, POOL, device="cuda")
        self.device.tensor.normal_()
        self.host = HostPool(layout, POOL)
        _random_pages(self.host)
        self.copier = Copier(self.device, self.host)

    def write(self, device_pages: list[int], host_pages: list[int]) -> CompletionEvent:
        """Returns the op's event: its copies are issued by a thread of their own."""
        return self.copier.write(device_pages, host_pages)[-1]

    def load(self, host_pages: list[int], device_pages: list[int]) -> CompletionEvent:
        return self.copier.load(host_pages, device_pages)[-1]

    def check(self, slots: list[int], moved: list[int], targets: list[int]) -> None:
        pages = self.host.tensor[slots].to("cuda").transpose(0, 1)      # layer-major, as the device pool
        for pages_of, name in ((moved, "write"), (targets, "load")):
            if not torch.equal(_bits(pages), _bits(self.device.tensor[:, pages_of])):
                raise HiCacheError(f"gpu-copies: Copier {name} of {len(slots)} pages moved wrong bytes")

    def close(self) -> None:
        self.copier.close()
        self.host.close()


def _random_pages(host: HostPool) -> None:
    """Random bits a registration at a time: one copy spanning two is refused."""
    pages = host.chunk_bytes // host.layout.page_bytes
    for first in range(0, host.tensor.shape[0], pages):
        chunk = host.tensor[first:first + pages]
        chunk.copy_(torch.randn(chunk.shape, dtype=chunk.dtype, device="cuda"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)      # bf16 compared bit for bit
