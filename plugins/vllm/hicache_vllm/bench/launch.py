"""How the bench starts its engine and server processes: `popen` is `subprocess.Popen`, unless
`warm` has handed it a fork server (`forkserver.py`), which then starts each
`python -m MODULE` it has imported as a fork in seconds, not ten. The test suite does that
for its session; the bench's own runs start cold, as a user's server does."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# read when Python starts or a module is imported, so a fork cannot take them from its request
AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "VLLM_LOGGING_LEVEL",
            "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX")
START_TIMEOUT_S = 120

_server: WarmStarts | None = None


def popen(args: list[str], **kwargs) -> subprocess.Popen | WarmProcess:
    """`subprocess.Popen(args, **kwargs)`, or, after `warm`, its server's `popen`."""
    return subprocess.Popen(args, **kwargs) if _server is None else _server.popen(args, **kwargs)


def warm(runs: tuple[str, ...], imports: tuple[str, ...], env: dict[str, str], log: Path) -> WarmStarts:
    """From now on, `python -m M` for each M of `runs` starts as a fork of one server that has
    imported `imports` under `env` (its stderr goes to `log`); it ends with this process."""
    global _server
    _server = WarmStarts(runs, imports, env, log)
    return _server


class WarmStarts:
    """The client of one fork server, started at the first start it takes."""

    def __init__(self, runs: tuple[str, ...], imports: tuple[str, ...], env: dict[str, str], log: Path) -> None:
        self.runs, self.imports, self.env, self.log = set(runs), imports, env, log
        self.path = os.path.join(tempfile.mkdtemp(prefix="hicache-warm-"), "socket")
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def _serving(self) -> None:
        if self.proc is not None:
            return
        # One BLAS thread: OpenBLAS (numpy's) starts its pool as it loads, and a server with a
        # second thread refuses to fork. A fork keeps the one thread; only numpy's BLAS sees it.
        env = {**self.env, "OPENBLAS_NUM_THREADS": "1"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.forkserver", self.path, *self.imports],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, env=env)
        atexit.register(self.close)
        deadline = time.monotonic() + START_TIMEOUT_S
        while (line := self.proc.stdout.readline()) != b"ready\n":
            if not line or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the fork server did not start (exit {self.proc.poll()}, log {self.log})")

    def popen(self, args: list[str], *, stdin=None, stdout=None, stderr=None, env: dict | None = None,
              cwd: str | None = None, start_new_session: bool = False, text: bool = False,
              preexec_fn=None) -> subprocess.Popen | WarmProcess:
        """A fork when this server runs `args`' module (`python -m M`) and `env` agrees with its
        own on what is read at start; else `subprocess.Popen`. (A fork runs no `preexec_fn`: it
        gets SIGTERM when the server dies, which is when this process does.)"""
        env = dict(os.environ if env is None else env)
        if self._takes(args, env):
            return self._start(args, (stdin, stdout, stderr), env, cwd or os.getcwd(), start_new_session, text)
        return subprocess.Popen(args, stdin=stdin, stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                start_new_session=start_new_session, text=text, preexec_fn=preexec_fn)

    def _takes(self, args: list[str], env: dict) -> bool:
        return ((self.proc is None or self.proc.poll() is None) and len(args) > 2
                and args[0] == sys.executable and args[1] == "-m" and args[2] in self.runs
                and all(env.get(k) == self.env.get(k) for k in AT_START))

    def _start(self, args: list[str], streams: tuple, env: dict, cwd: str, new_session: bool,
               text: bool) -> WarmProcess:
        self._serving()
        sys.audit("subprocess.Popen", args[0], args, cwd, env)     # counted as any start is
        ours, theirs, opened = [], [], []
        for i, want in enumerate(streams):
            mine = None
            if want == subprocess.PIPE:
                read, write = os.pipe()
                mine = os.fdopen(write if i == 0 else read, ("w" if i == 0 else "r") + ("" if text else "b"))
                fd = read if i == 0 else write
                opened.append(fd)
            elif want == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
            elif want == subprocess.STDOUT:
                fd = theirs[1]
            else:
                fd = i if want is None else want if isinstance(want, int) else want.fileno()
            ours.append(mine)
            theirs.append(fd)
        request = {"module": args[2], "args": args[3:], "env": env, "cwd": cwd, "new_session": new_session}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        body = json.dumps(request).encode()
        socket.send_fds(conn, [len(body).to_bytes(4, "big")], theirs)
        conn.sendall(body)
        for fd in opened:
            os.close(fd)
        self.starts += 1
        return WarmProcess(args, conn, *ours)

    def close(self) -> None:
        if self.proc is None:
            return
        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WarmProcess:
    """What callers use of a `subprocess.Popen`, for a fork of the warm server: its pid, pipes,
    signals and exit code, which comes over the request's connection."""

    def __init__(self, args: list[str], conn: socket.socket, stdin, stdout, stderr) -> None:
        self.args, self._conn, self._said = args, conn, b""
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        started = self._answer(START_TIMEOUT_S)
        if "pid" not in started:
            conn.close()
            raise RuntimeError(started.get("refused", "the fork server ended before it started the process"))
        self.pid = started["pid"]

    def _answer(self, timeout: float | None) -> dict:
        """The server's next line on this connection; {} once it is gone without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._said:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(4096)
            if not chunk:
                return {}
            self._said += chunk
        line, self._said = self._said.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._answer(timeout).get("exit", -signal.SIGKILL)    # none: the server died
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
