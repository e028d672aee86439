"""Run a real `mooncake_master` (with its HTTP metadata server) on free loopback ports."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from hicache_async.errors import StorageError


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class MooncakeMaster:
    """Context manager owning one master process; `restart()` brings it back on the same ports."""

    def __init__(self, host: str = "127.0.0.1", rpc_port: int = 0, http_port: int = 0,
                 metrics_port: int = 0, start_timeout_s: float = 30.0, log_path: str | None = None) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)  # its default, 9003, clashes between masters
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def start(self) -> "MooncakeMaster":
        """Start the master and wait (bounded) until both its ports accept connections."""
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                [find_master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
                 "--enable_http_metadata_server=true", f"--http_metadata_server_host={self.host}",
                 f"--http_metadata_server_port={self.http_port}",
                 f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}"],
                stdout=log, stderr=subprocess.STDOUT)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not (port_open(self.host, self.rpc_port, 0.2) and port_open(self.host, self.http_port, 0.2)):
            if self._proc.poll() is not None:
                raise StorageError(f"mooncake_master exited with code {self._proc.returncode} "
                                   f"before listening on {self.address}")
            if time.monotonic() > deadline:
                self.stop()
                raise StorageError(f"mooncake_master not listening on {self.address} "
                                   f"after {self.start_timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Terminate, then kill if it lingers."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
