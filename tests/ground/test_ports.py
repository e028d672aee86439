"""A port picked for a server to bind later lies where no outgoing connection can take it."""
from __future__ import annotations

import socket

from hicache_async import ports
from hicache_async.ports import free_port


def _ephemeral_low() -> int:
    with open(ports.EPHEMERAL_RANGE) as f:
        return int(f.read().split()[0])


def test_picked_ports_lie_below_the_ephemeral_range_and_bind():
    low = _ephemeral_low()
    picked = [free_port() for _ in range(200)]
    assert all(ports.LOWEST <= port < low for port in picked)
    assert len(set(picked)) > 150   # spread out, so two servers rarely ask for the same one
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[0]))


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        only = taken.getsockname()[1]
        monkeypatch.setattr(ports, "_below_ephemeral", lambda: range(only, only + 1))
        assert free_port() != only


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(tmp_path, monkeypatch):
    squeezed = tmp_path / "range"
    squeezed.write_text(f"{ports.LOWEST}\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", str(squeezed))
    port = free_port()
    assert port >= _ephemeral_low()   # the kernel's own pick: nothing was left to sample
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
