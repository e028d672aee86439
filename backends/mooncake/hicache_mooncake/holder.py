"""The segment holder: a long-lived Mooncake client that mounts one large global segment.

Mooncake keeps an object's bytes in a segment some client mounted; they vanish when that
client exits. Rank clients therefore mount no segment of their own (`segment_bytes=0`) and
their puts land here, in a process that lives as long as the master, so L3 outlives every
run. After a master restart the client re-mounts the segment by itself.

Run by `MooncakeMaster` (or `python -m hicache_mooncake.serve`) as
`python -m hicache_mooncake.holder --master HOST:PORT --metadata-url URL --segment-bytes N`;
prints `ready` once mounted and exits on SIGTERM/SIGINT or when its parent goes away.
Imports only mooncake (no torch), so it starts in a fraction of a second.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

READY = "ready"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_mooncake.holder", description=__doc__.split("\n")[0])
    parser.add_argument("--master", required=True, metavar="HOST:PORT")
    parser.add_argument("--metadata-url", required=True, metavar="URL")
    parser.add_argument("--segment-bytes", type=int, required=True)
    parser.add_argument("--local-hostname", default="127.0.0.1")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--device-name", default="")
    ns = parser.parse_args(argv)
    from mooncake.store import MooncakeDistributedStore

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()
    store = MooncakeDistributedStore()
    rc = store.setup(ns.local_hostname, ns.metadata_url, ns.segment_bytes, 1 << 20, ns.protocol,
                     ns.device_name, ns.master)
    if rc != 0:
        print(f"mooncake segment holder: setup against master {ns.master} failed with code {rc}",
              file=sys.stderr, flush=True)
        return 1
    print(READY, flush=True)
    try:
        while not stop.wait(0.5) and os.getppid() == parent:
            pass
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
