"""The CPU copier: any page pattern lands byte for byte through either path (index kernels for
small slabs, run copies shared by two threads for big ones), each layer's event is set only
once its bytes have landed, and a failure on either thread fails the op's events."""
import asyncio
import threading

import pytest
import torch

from hicache_async import faults
from hicache_async.pools import DevicePool, HostPool
from hicache_async.transfer import cpu_copies
from hicache_async.transfer import run_plan
from hicache_async.transfer.copier import Copier, CopyFailed
from hicache_async.transfer.run_plan import RunPlan
from tests.helpers.page_patterns import LAYOUTS, PATTERNS, POOL_PAGES, assert_moves_exactly, assert_round_trip

BIG = LAYOUTS["big"]


@pytest.fixture
def many_groups(monkeypatch):
    """A copy per slab and a group per layer: the two threads share every group of an op."""
    monkeypatch.setattr(run_plan, "_PIECE_BYTES", BIG.layer_page_bytes)
    monkeypatch.setattr(run_plan, "_GROUP_BYTES", 1)


def _copier(fault: str | None = None, monkeypatch=None) -> Copier:
    if fault:
        monkeypatch.setenv(faults.ENV, fault)
    return Copier(DevicePool(BIG, POOL_PAGES), HostPool(BIG, POOL_PAGES))


def _wait(events) -> None:
    asyncio.run(events[-1].wait(10, "copy"))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_pages_land_exactly_in_both_directions(pattern, layout):
    assert_round_trip(layout, *pattern, device="cpu")


@pytest.mark.parametrize("pattern", PATTERNS.values(), ids=PATTERNS.keys())
def test_pages_land_exactly_when_both_threads_share_every_group(pattern, many_groups):
    copier = _copier()
    try:
        assert_moves_exactly(copier, *pattern)
    finally:
        copier.close()


def test_big_slabs_move_as_run_copies_and_small_ones_through_the_index_kernels():
    for name, runs in (("big", True), ("wide", False), ("odd", False)):
        layout = LAYOUTS[name]
        assert (RunPlan.of([9, 2, 5], [1, 7, 3], layout.num_layers, layout.layer_page_bytes) is not None) == runs, name


@pytest.mark.parametrize("group_layers", [1, 2])
def test_each_event_is_set_in_order_once_its_group_of_layers_has_landed(group_layers, many_groups, monkeypatch):
    """When a layer's event is set, every layer of its group is already in the host pool
    (checked from the worker, while later groups may still be moving)."""
    device_pages, host_pages = [3, 9, 4, 12, 0], [7, 1, 2, 15, 8]
    monkeypatch.setattr(run_plan, "_GROUP_BYTES", group_layers * len(device_pages) * BIG.layer_page_bytes)
    copier = _copier()
    copier.device.tensor.normal_()
    assert RunPlan.of(device_pages, host_pages, BIG.num_layers, BIG.layer_page_bytes).group == group_layers
    seen: list[int] = []

    class Checked(cpu_copies.HostEvent):
        def set(self) -> None:
            layer = len(seen)
            first = layer - layer % group_layers
            for mate in range(first, first + group_layers):
                for d, h in zip(device_pages, host_pages):
                    assert torch.equal(copier.host.tensor[h, mate], copier.device.tensor[mate, d]), (layer, mate, d)
            seen.append(layer)
            super().set()

    monkeypatch.setattr(cpu_copies, "HostEvent", Checked)
    events = copier.write(device_pages, host_pages)
    _wait(events)
    copier.close()
    assert seen == list(range(BIG.num_layers)) and all(e.error is None for e in events)


def test_a_failed_write_fails_every_event_and_the_next_op_still_lands(monkeypatch, many_groups):
    copier = _copier("copy-error", monkeypatch)
    try:
        events = copier.write([1, 2, 3], [4, 5, 6])
        _wait(events)
        assert all(isinstance(e.error, CopyFailed) for e in events)
        assert_moves_exactly(copier, [1, 2, 3], [4, 5, 6])      # the fault fires once
    finally:
        copier.close()


def test_a_failure_on_the_helper_thread_fails_the_op_from_its_layer_on(monkeypatch, many_groups):
    copier = _copier()
    real_move, calls = RunPlan.move, []

    def move(src, dst, copies):
        if threading.current_thread().name.startswith("hicache-copy-helper"):
            calls.append(1)
            if len(calls) == 3:                 # the helper's third group
                raise RuntimeError("helper broke")
        real_move(src, dst, copies)

    monkeypatch.setattr(RunPlan, "move", staticmethod(move))
    try:
        events = copier.write([1, 2, 3], [4, 5, 6])
        _wait(events)
        assert all(e.error is None for e in events[:2])
        assert all(isinstance(e.error, CopyFailed) and "helper broke" in str(e.error) for e in events[2:])
        monkeypatch.setattr(RunPlan, "move", staticmethod(real_move))
        assert_moves_exactly(copier, [1, 2, 3], [4, 5, 6])
    finally:
        copier.close()


@pytest.mark.parametrize("layout", ["big", "wide"])
@pytest.mark.parametrize("pages", [[POOL_PAGES - 1, POOL_PAGES], [-1, 0]])
def test_pages_outside_the_pool_fail_the_op_instead_of_copying_less(layout, pages):
    c = Copier(DevicePool(LAYOUTS[layout], POOL_PAGES), HostPool(LAYOUTS[layout], POOL_PAGES))
    events = c.write([0, 1], pages)
    _wait(events)
    c.close()
    assert all(isinstance(e.error, CopyFailed) for e in events)


def test_a_swapped_load_puts_the_first_two_pages_in_each_others_slots(monkeypatch):
    copier = _copier("swap-load-pages", monkeypatch)
    copier.host.tensor.normal_()
    _wait(copier.load([2, 3, 4], [5, 6, 7]))
    copier.close()
    device = copier.device.tensor
    assert torch.equal(device[:, 5], copier.host.tensor[3])
    assert torch.equal(device[:, 6], copier.host.tensor[2]) and torch.equal(device[:, 7], copier.host.tensor[4])


def test_a_noisy_load_changes_the_pages_it_delivers_and_no_others(monkeypatch, many_groups):
    copier = _copier("noise-load", monkeypatch)
    copier.host.tensor.normal_()
    before = copier.device.tensor.clone()
    _wait(copier.load([2, 3], [5, 9]))
    copier.close()
    device, host = copier.device.tensor, copier.host.tensor
    for h, d in ((2, 5), (3, 9)):
        assert not torch.equal(device[:, d], host[h]) and torch.allclose(device[:, d], host[h], rtol=1e-2, atol=1e-2)
    others = [p for p in range(POOL_PAGES) if p not in (5, 9)]
    assert torch.equal(device[:, others], before[:, others])
