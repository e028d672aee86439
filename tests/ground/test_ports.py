"""A port picked for a server to bind later lies where no outgoing connection can take it, and
no other pick on the machine gets it while its server may still be starting."""
from __future__ import annotations

import json
import multiprocessing
import socket

import pytest

from hicache_async import ports
from hicache_async.ports import free_port


@pytest.fixture(autouse=True)
def own_reservations(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "RESERVATIONS", str(tmp_path / "ports.json"))


def _ephemeral_low() -> int:
    with open(ports.EPHEMERAL_RANGE) as f:
        return int(f.read().split()[0])


def test_picked_ports_lie_below_the_ephemeral_range_and_bind():
    low = _ephemeral_low()
    picked = [free_port() for _ in range(200)]
    assert all(ports.LOWEST <= port < low for port in picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[0]))


def _pick_many(count: int, out) -> None:
    out.send([free_port() for _ in range(count)])


def test_no_two_picks_on_the_machine_get_one_port_while_it_is_held(monkeypatch):
    """Four processes take 25 ports each from 120: unguarded, two would share one almost surely."""
    band = range(ports.LOWEST + 1000, ports.LOWEST + 1120)    # below the ephemeral range: no client takes it
    monkeypatch.setattr(ports, "_below_ephemeral", lambda: band)
    context = multiprocessing.get_context("fork")   # the children keep the patches above
    pipes = [context.Pipe(duplex=False) for _ in range(4)]
    children = [context.Process(target=_pick_many, args=(25, child)) for _, child in pipes]
    for child in children:
        child.start()
    picked = [port for parent, _ in pipes for port in parent.recv()]
    for child in children:
        child.join(10)
    assert len(picked) == 100 and len(set(picked)) == 100
    assert all(port in band for port in picked)


def test_a_reservation_lapses_after_its_hold(monkeypatch):
    monkeypatch.setattr(ports, "HOLD_S", 0.0)
    only = free_port()
    monkeypatch.setattr(ports, "_below_ephemeral", lambda: range(only, only + 1))
    assert free_port() == free_port() == only


def test_a_torn_reservation_file_is_started_afresh():
    with open(ports.RESERVATIONS, "w") as f:
        f.write('{"40000": ')
    port = free_port()
    assert ports.LOWEST <= port < _ephemeral_low()
    with open(ports.RESERVATIONS) as f:
        assert list(json.load(f)) == [str(port)]


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
