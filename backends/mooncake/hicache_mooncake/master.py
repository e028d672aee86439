"""Run a real `mooncake_master` (with its HTTP metadata server) and a segment holder beside it.

The holder (see `holder.py`) mounts the memory objects live in, so they outlive the rank
clients that put them: two runs against one master share L3."""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hicache_async.errors import StorageError, UsageError
from hicache_async.ports import free_port


def find_master_binary() -> str:
    """`mooncake_master` beside this interpreter, on PATH, or inside the mooncake package."""
    candidates = [Path(sys.executable).parent / "mooncake_master", shutil.which("mooncake_master")]
    try:
        import mooncake
        candidates.append(Path(mooncake.__file__).parent / "mooncake_master")
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file():
            return str(c)
    raise StorageError("mooncake_master not found: install the mooncake extra (pip install 'hicache-async[mooncake]')")


def port_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def check_reachable(master: str, metadata_url: str, timeout_s: float = 3.0) -> None:
    """Raise StorageError naming the first of the master and its metadata server not accepting connections."""
    from urllib.parse import urlparse

    host, _, port = master.rpartition(":")
    meta = urlparse(metadata_url)
    for what, h, p in (("master", host, port), ("metadata server", meta.hostname, meta.port)):
        if h and p and not port_open(h, int(p), timeout_s):
            raise StorageError(f"mooncake {what} {h}:{p} unreachable")


DEFAULT_HOLDER_BYTES = 1 << 30  # reserved, touched only as objects arrive


class MooncakeMaster:
    """Context manager owning a master process and its segment holder.

    `holder_bytes=0` starts no holder: objects then live in the clients' own segments and go
    with them. `start()` starts whichever of the two is not running; `stop()` stops both;
    `kill_master()` and `restart()` touch only the master, and the holder re-mounts its
    segment once a master is back on the same ports (objects the old master knew are lost).
    """

    def __init__(self, host: str = "127.0.0.1", rpc_port: int = 0, http_port: int = 0,
                 metrics_port: int = 0, holder_bytes: int = DEFAULT_HOLDER_BYTES,
                 start_timeout_s: float = 30.0, log_path: str | None = None) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)  # its default, 9003, clashes between masters
        self.holder_bytes = holder_bytes
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._holder: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def pid(self) -> int | None:
        """The master process id (None when not running)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def pids(self) -> list[int]:
        """The store's processes running now: the master and its segment holder."""
        return [p.pid for p in (self._proc, self._holder) if p is not None and p.poll() is None]

    def running(self) -> bool:
        """Whether the master, and the holder if one is wanted, are both alive."""
        alive = [p is not None and p.poll() is None for p in (self._proc, self._holder)]
        return alive[0] and (alive[1] or not self.holder_bytes)

    def start(self) -> "MooncakeMaster":
        """Start the master (and holder) if not running; wait, bounded, until they serve."""
        try:
            if self._proc is None or self._proc.poll() is not None:
                self._start_master()
            if self.holder_bytes and (self._holder is None or self._holder.poll() is not None):
                self._start_holder()
        except BaseException:
            self.stop()
            raise
        return self

    def _log(self):
        return open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL

    def _start_master(self) -> None:
        log = self._log()
        try:
            self._proc = subprocess.Popen(
                [find_master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
                 "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                 f"--http_metadata_server_port={self.http_port}",
                 f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}"],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_dies_with_us())
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not (port_open(self.host, self.rpc_port, 0.2) and port_open(self.host, self.http_port, 0.2)):
            if self._proc.poll() is not None:
                raise StorageError(f"mooncake_master exited with code {self._proc.returncode} "
                                   f"before listening on {self.address}")
            if time.monotonic() > deadline:
                raise StorageError(f"mooncake_master not listening on {self.address} "
                                   f"after {self.start_timeout_s:.0f} s")
            time.sleep(0.05)

    def _start_holder(self) -> None:
        """Start the holder and wait until it prints `ready` (its segment is mounted)."""
        from .holder import READY

        err = open(self.log_path, "ab") if self.log_path else tempfile.TemporaryFile()
        try:
            self._holder = subprocess.Popen(
                [sys.executable, "-m", "hicache_mooncake.holder", "--master", self.address,
                 "--metadata-url", self.metadata_url, "--segment-bytes", str(self.holder_bytes),
                 "--local-hostname", self.host],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, preexec_fn=_dies_with_us(),
                env={**os.environ, "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")]))})
            deadline = time.monotonic() + self.start_timeout_s
            line = b""
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(f"mooncake segment holder not ready after {self.start_timeout_s:.0f} s "
                                       f"(master {self.address})")
                if select.select([self._holder.stdout], [], [], min(left, 0.2))[0]:
                    chunk = os.read(self._holder.stdout.fileno(), 256)
                    if not chunk:
                        break
                    line += chunk
            if line.strip() != READY.encode():
                self._holder.wait(timeout=5)
                raise StorageError(f"mooncake segment holder exited with code {self._holder.returncode} "
                                   f"(master {self.address}){_last_line(err)}")
        finally:
            err.close()

    def kill_master(self) -> None:
        """SIGKILL the master alone, as a crash would; the holder keeps running."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=5)

    def stop(self) -> None:
        """Stop the holder, then the master: terminate, then kill if either lingers."""
        holder, self._holder = self._holder, None
        proc, self._proc = self._proc, None
        for p in (holder, proc):
            if p is not None:
                _stop(p)
                if p.stdout is not None:
                    p.stdout.close()

    def restart(self) -> None:
        """Bring the master back on the same ports; the holder re-mounts by itself."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)
        self.start()

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _last_line(f) -> str:
    """`: <last line of the holder's stderr that names itself>`, or nothing."""
    try:
        f.seek(0)
        lines = [l for l in f.read().decode(errors="replace").splitlines() if "segment holder" in l]
    except (OSError, ValueError):
        return ""
    return f": {lines[-1]}" if lines else ""


def default_metadata_url(master: str) -> str:
    """The metadata server a master at HOST:PORT serves by default: http://HOST:8080/metadata."""
    host, sep, port = master.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--mooncake-master must be HOST:PORT, got {master!r}")
    return f"http://{host}:8080/metadata"


def _dies_with_us():
    """A Popen preexec_fn: the child is SIGKILLed when this process dies, even by SIGKILL, so a
    killed CLI never leaves a master or holder behind."""
    from hicache_async.sim.ranks.launcher import die_with_parent  # imports torch: not for `--help`

    parent = os.getpid()
    return lambda: die_with_parent(parent)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate, then kill after 5 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
