"""Page patterns for the copier, and the byte-exact round trip every device runs them through."""
import asyncio
import random

import torch

from hicache_async.layout import KVLayout
from hicache_async.pools import DevicePool, HostPool
from hicache_async.transfer.copier import Copier
from hicache_async.transfer.sim_device import SimDevice

POOL_PAGES = 16
_rng = random.Random(16)
# (device pages, host pages): a write moves device page d[i] to host page h[i], a load the reverse.
PATTERNS = {
    "empty": ([], []),
    "one page": ([9], [3]),
    "contiguous": (list(range(2, 8)), list(range(10, 16))),
    "reversed": (list(range(7, 1, -1)), list(range(10, 4, -1))),
    "random": (_rng.sample(range(POOL_PAGES), 9), _rng.sample(range(POOL_PAGES), 9)),
    "all pages shuffled": (_rng.sample(range(POOL_PAGES), POOL_PAGES), _rng.sample(range(POOL_PAGES), POOL_PAGES)),
    "scattered to a run": ([11, 0, 6, 3], [4, 5, 6, 7]),
    "a run to scattered": ([4, 5, 6, 7], [11, 0, 6, 3]),
}
# Slabs of 256 bytes (moved as 16-byte words) and of 6 bytes (moved as 2-byte words): small
# enough for the index kernels on CPU; slabs of 32 KiB, which the CPU moves as run copies; one
# layer of 16 KiB pages, whose consecutive pages are one run in both pools (one DMA copy, cut
# where registrations meet: a registration may be a page).
LAYOUTS = {
    "wide": KVLayout(num_layers=3, kv_heads=2, head_dim=8, page_size=4, dtype=torch.float16),
    "odd": KVLayout(num_layers=2, kv_heads=1, head_dim=3, page_size=1, dtype=torch.bfloat16, attention="mla"),
    "big": KVLayout(num_layers=4, kv_heads=8, head_dim=64, page_size=16, dtype=torch.float16),
    "one layer": KVLayout(num_layers=1, kv_heads=8, head_dim=64, page_size=8, dtype=torch.float16),
}


def _random_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    """Every 16-bit pattern, NaNs and negative zeros included: a copy must keep them all."""
    bits = torch.randint(-2 ** 15, 2 ** 15, t.shape, dtype=torch.int16, generator=gen)
    t.copy_(bits.view(t.dtype).to(t.device))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def simulated(host: HostPool, seed: int = 1, max_delay_s: float = 2e-4, bound_s: float = 5.0) -> SimDevice:
    """The simulated device with `host` registered: the copies a CUDA pool's pages take, on the CPU."""
    device = SimDevice(seed=seed, max_delay_s=max_delay_s, bound_s=bound_s)
    device.register(host)
    return device


def assert_round_trip(layout: KVLayout, device_pages: list[int], host_pages: list[int], device: str,
                      on_simulated_device: bool = False) -> None:
    """Write then load the pattern (CPU pools by DMA over the simulated device where asked); the
    reference is built page by page with plain indexing."""
    dev, host = DevicePool(layout, POOL_PAGES, device=device), HostPool(layout, POOL_PAGES)
    copier = Copier(dev, host, dma=simulated(host) if on_simulated_device else None)
    try:
        assert_moves_exactly(copier, device_pages, host_pages)
    finally:
        copier.close()


def assert_moves_exactly(copier: Copier, device_pages: list[int], host_pages: list[int]) -> None:
    """Both directions through `copier`, over random bits, against page-by-page references."""
    dev, host, layout = copier.device, copier.host, copier.device.layout
    gen = torch.Generator().manual_seed(len(device_pages))
    _random_bits(dev.tensor, gen)
    _random_bits(host.tensor, gen)
    expected = host.tensor.clone()
    for d, h in zip(device_pages, host_pages):
        expected[h] = dev.tensor[:, d].cpu()
    _wait_all(copier.write(device_pages, host_pages), layout)
    assert _same_bytes(host.tensor, expected), "write"

    _random_bits(host.tensor, gen)          # new bytes, so a load that moved nothing fails
    expected = dev.tensor.cpu().clone()
    for d, h in zip(device_pages, host_pages):
        expected[:, d] = host.tensor[h]
    _wait_all(copier.load(host_pages, device_pages), layout)
    assert _same_bytes(dev.tensor, expected), "load"


def _wait_all(events, layout: KVLayout) -> None:
    assert len(events) == layout.num_layers
    asyncio.run(events[-1].wait(10, "copy"))
    assert all(e.query() and e.error is None for e in events)
