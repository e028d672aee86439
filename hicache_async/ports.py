"""A loopback port for a server that another process will bind later.

Between the pick and that bind (seconds, for a vLLM server still importing) the port is free for
anyone to take, so two guards:
- A port the kernel hands out (bind to 0) comes from its ephemeral range, the range every
  outgoing connection takes its local port from; CI saw a rank 0 lose its port that way
  (EADDRINUSE). We pick below that range, where only an explicit bind lands.
- Every pick on this machine is written to one reservation file, under a lock, and no other pick
  returns it for `HOLD_S`; CI saw two servers of one run handed the same port.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
RESERVATIONS = os.path.join(tempfile.gettempdir(), "hicache-async-ports.json")
HOLD_S = 600.0       # a vLLM server binds before it builds its engine: its imports' time, far less
LOWEST = 20000       # clear of servers' default ports and of those Mooncake picks for itself (15xxx)
TRIES = 64
_PICK = random.SystemRandom()  # the OS's entropy: forks of one process must not pick alike


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now, promised to no other pick on this machine, and outside
    the kernel's ephemeral range if there is room below it (else one the kernel picks)."""
    candidates = _below_ephemeral()
    with _reservations() as held:
        for port in _PICK.sample(candidates, min(TRIES, len(candidates))):
            if port not in held and _bindable(host, port):
                break
        else:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        held[port] = time.time() + HOLD_S
    return port


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _reservations() -> Iterator[dict[int, float]]:
    """The unexpired reservations {port: until}, held under an exclusive lock and written back;
    a file we may not open (another user's) leaves picks to the bind check alone."""
    try:
        f = open(RESERVATIONS, "a+")
    except OSError:
        yield {}
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        held = _unexpired(f.read())
        yield held
        f.seek(0)
        f.truncate()
        json.dump(held, f)
        f.flush()


def _unexpired(text: str) -> dict[int, float]:
    now = time.time()
    try:
        return {int(port): float(until) for port, until in json.loads(text or "{}").items()
                if float(until) > now}
    except (ValueError, TypeError, AttributeError):
        return {}      # a torn or foreign file: its promises are unknowable, start afresh


def _below_ephemeral() -> range:
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(LOWEST, low)
