"""`python -m hicache_mooncake.serve`: a mooncake_master plus its segment holder, until Ctrl-C.

Runs that point at it (`hicache-async simulate --storage mooncake --mooncake-master HOST:PORT
--mooncake-metadata URL`) share L3: their objects live in the holder's segment, not in the
ranks. Prints the master address and metadata URL once both serve.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from hicache_async.errors import StorageError

from .master import DEFAULT_HOLDER_BYTES, MooncakeMaster


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4G or 512M, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_mooncake.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    parser.add_argument("--rpc-port", type=int, default=50051, help="master RPC port (default 50051)")
    parser.add_argument("--http-port", type=int, default=8080, help="metadata server port (default 8080)")
    parser.add_argument("--metrics-port", type=int, default=0, help="master metrics port (default: a free one)")
    parser.add_argument("--segment", type=_size, default=DEFAULT_HOLDER_BYTES, metavar="SIZE",
                        help="memory the holder mounts for objects, e.g. 8G (default 1G)")
    parser.add_argument("--log", metavar="PATH", help="append master and holder logs here (default: discard)")
    ns = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    master = MooncakeMaster(ns.host, ns.rpc_port, ns.http_port, ns.metrics_port, holder_bytes=ns.segment,
                            log_path=ns.log)
    try:
        master.start()
    except StorageError as exc:
        print(f"hicache_mooncake.serve: error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"mooncake master  {master.address}\nmetadata server  {master.metadata_url}\n"
              f"segment holder   {ns.segment >> 20} MiB\n"
              f"use: hicache-async simulate --storage mooncake --mooncake-master {master.address} "
              f"--mooncake-metadata {master.metadata_url}\n(Ctrl-C stops both)", flush=True)
        while not stop.wait(1.0):
            if not master.running():
                print("hicache_mooncake.serve: error: the master or its segment holder exited", file=sys.stderr)
                return 1
    finally:
        master.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
