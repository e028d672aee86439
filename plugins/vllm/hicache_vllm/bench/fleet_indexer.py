"""Dynamo's standalone KV indexer (`python -m dynamo.indexer`) on a free port, in a process
group of its own, for the fleet bench and its tests: what a router queries for overlap."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hicache_async.errors import HiCacheError
from hicache_async.ports import free_port
from hicache_async.sim.ranks.launcher import die_with_parent

START_TIMEOUT_S = 60


class Indexer:
    def __init__(self, log: Path) -> None:
        self.log, self.port = log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        parent = os.getpid()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
                                          "--threads", "1"], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=lambda: die_with_parent(parent))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{self.url}/workers", timeout=2).status == 200:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise HiCacheError(f"dynamo.indexer on port {self.port} did not serve (log {log})")
            time.sleep(0.2)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self) -> "Indexer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
