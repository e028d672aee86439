"""A loopback port for a server that another process will bind later.

Between the pick and that bind the port is free for anyone to take. A port the kernel hands out
(bind to 0) comes from its ephemeral range, the same range every outgoing connection takes its
local port from, so on a busy machine a gloo or HTTP client can take it in that gap (CI saw
EADDRINUSE). We pick below that range instead, where only an explicit bind can land.
"""
from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 20000       # clear of servers' default ports and of those Mooncake picks for itself (15xxx)
TRIES = 64
_PICK = random.SystemRandom()  # the OS's entropy: forks of one process must not pick alike


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now and outside the kernel's ephemeral range, if it has room
    below that range; otherwise one the kernel picks."""
    candidates = _below_ephemeral()
    for port in _PICK.sample(candidates, min(TRIES, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _below_ephemeral() -> range:
    try:
        with open(EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(LOWEST, low)
