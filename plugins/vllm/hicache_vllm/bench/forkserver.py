"""A process that imports vLLM once, then forks each `python -m MODULE ARGS` asked of it.

An engine or server process spends most of its start importing vLLM (about three quarters of a
cold engine start, profiled on two cores); a fork of a process that has done so starts in the
rest. Each child is still a process of its own: its pid, its session if asked, its environment,
working directory and standard streams (passed over the socket), and it exits through
interpreter shutdown as a fresh process does (atexit handlers, our connector's flush).
Single-threaded, so that forking it is safe: one select loop accepts requests and reaps
children, answering each request's connection with the child's pid and later its exit code
(negative: the signal). Checked before each fork, by the kernel's count (`threading` sees none a
native library started): a second thread refuses the request, in one line. It exits when its
stdin closes (its parent died); its children then get SIGTERM.

`python -m hicache_vllm.bench.forkserver SOCKET MODULE...` imports the modules, says
`ready` on stdout and serves `launch.WarmStarts` on SOCKET.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys

from hicache_async.sim.ranks.launcher import die_with_parent


def serve(listener: socket.socket) -> dict | None:
    """Until stdin closes (None), or, in a forked child, its request."""
    waiting: dict[int, socket.socket] = {}      # child pid -> its request's connection
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.1)
        for pid, code in _reaped():
            conn = waiting.pop(pid, None)
            if conn is not None:
                with conn:
                    _say(conn, {"exit": code})
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return None
        if listener in ready:
            conn, _ = listener.accept()
            request, fds = _request(conn)
            if (threads := thread_count()) > 1:
                _refuse(conn, fds, f"the fork server runs {threads} threads, not 1: a fork of it could "
                                   f"inherit a lock another thread held (imported: {', '.join(sys.argv[2:])})")
                continue
            sys.stdout.flush()
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *waiting.values()):
                    other.close()
                _become(request, fds, server)
                return request
            for fd in fds:
                os.close(fd)
            _say(conn, {"pid": pid})
            waiting[pid] = conn


def thread_count() -> int:
    """This process's threads as the kernel counts them, native ones included."""
    return len(os.listdir("/proc/self/task"))


def _refuse(conn: socket.socket, fds: list[int], why: str) -> None:
    print(f"forkserver: {why}", file=sys.stderr, flush=True)
    for fd in fds:
        os.close(fd)
    with conn:
        _say(conn, {"refused": why})


def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request: its length and the child's stdin, stdout and stderr, then its JSON."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    head += _exactly(conn, 4 - len(head))
    return json.loads(_exactly(conn, int.from_bytes(head, "big"))), fds


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the request ended early")
        data += chunk
    return data


def _reaped():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _say(conn: socket.socket, answer: dict) -> None:
    try:
        conn.sendall(json.dumps(answer).encode() + b"\n")
    except OSError:
        pass        # its client is gone: nobody waits for the answer


def _become(request: dict, fds: list[int], server: int) -> None:
    """This child turns into the asked process, as far as it can see."""
    if request.get("new_session"):
        os.setsid()
    die_with_parent(server, signal.SIGTERM)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [request["module"], *request["args"]]


def main() -> None:
    path, modules = sys.argv[1], sys.argv[2:]
    for module in modules:
        importlib.import_module(module)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(16)
        print("ready", flush=True)
        request = serve(listener)
    if request is not None:     # a forked child: run its module afresh, then exit as that process would
        sys.modules.pop(request["module"], None)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
