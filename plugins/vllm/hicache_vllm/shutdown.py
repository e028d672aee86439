"""A worker's way out: the backups it issued reach L3 before its process ends, or one line
says how many did not.

How vLLM 0.32 stops, from its code: `vllm serve`, on SIGTERM or SIGINT, stops its engine
client with `--shutdown-timeout` seconds (default 0). The EngineCore process gets SIGTERM,
drains its requests (at 0: aborts them), shuts its executor down, and is killed when that
time is up; at 0 it is killed at once, before anything can flush. A worker in a process of
its own (the multiprocessing executor: every CPU engine, and TP or PP > 1 on GPUs) then has
`VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS` (default 5) to exit, gets SIGTERM, and SIGKILL 4 s
later. On the way out vLLM calls the connector's `shutdown`, and the worker flushes
(`flush`). So a flush of `flush_timeout` seconds needs both windows longer; a worker whose
windows are shorter says so once, at start. In a process where nothing handles SIGTERM (an
in-process `LLM`), SIGTERM exits through Python's shutdown, whose atexit hook flushes. While
a flush runs, further SIGTERMs and SIGINTs are held off: it is bounded already.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from concurrent.futures import Future, wait

import structlog

log = structlog.get_logger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def on_signals(flush_timeout: float) -> None:
    """At a worker's start: SIGTERM exits through Python's shutdown where nothing else handles
    it, and one warning if vLLM would kill this worker before a flush could end."""
    if _main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit)
    short = [f"{name} is {s}" for name, s in _vllm_windows().items() if s is not None and s < flush_timeout]
    if short:
        log.warning(f"hicache: vLLM may kill this worker before its backups reach L3: {' and '.join(short)} "
                    f"(seconds), under flush_timeout {flush_timeout:g}; raise them for a graceful drain")


def _vllm_windows() -> dict[str, float | None]:
    """vLLM's two shutdown windows, in seconds; none where no vLLM is installed (a worker side
    driven by a test on a machine without it)."""
    try:
        import vllm.envs as envs
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return {}
    cfg = get_current_vllm_config_or_none()
    return {"--shutdown-timeout": cfg.shutdown_timeout if cfg is not None else None,
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS}


def flush(running: dict[Future, int], timeout: float) -> int:
    """Wait up to `timeout` seconds for the L3 jobs still `running` (each with the pages it
    writes), signals held off; the pages left unwritten (logged, in one line, when any)."""
    with _held():
        _, abandoned = wait(list(running), timeout=timeout)
    lost = sum(running.get(f, 0) for f in abandoned)
    if abandoned:
        log.warning("hicache shutdown: L3 jobs cancelled after flush_timeout; their pages are not in L3",
                    jobs=len(abandoned), pages=lost, flush_timeout=timeout)
    return lost


def _exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _held():
    """SIGTERM and SIGINT noted and dropped, then the former handlers back."""
    if not _main_thread():      # only the main thread may set handlers; signals go to it anyway
        yield
        return
    former = {s: signal.signal(s, _note) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in former.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _note(signum: int, frame) -> None:
    log.info("hicache shutdown: signal held while backups flush", signal=signal.Signals(signum).name)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
