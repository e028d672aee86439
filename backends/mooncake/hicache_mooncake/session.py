"""What `--storage mooncake` brings to a run: its flags, and the master its ranks talk to.

With `--mooncake-master` the run uses that master (and its segment holder), checked reachable
once before any rank starts, and objects outlive the run. Without it the run starts a private
master and holder on free loopback ports and stops them when it ends.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
from collections.abc import Iterator
from urllib.parse import urlparse

from hicache_async.errors import UsageError

from .master import MooncakeMaster, check_reachable, default_metadata_url

NEEDS_EXTRA = "--storage mooncake needs the mooncake extra: pip install 'hicache-async[mooncake]'"


def _master(text: str) -> str:
    try:
        default_metadata_url(text)
    except UsageError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}") from None
    return text


def _metadata_url(text: str) -> str:
    parsed = urlparse(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise argparse.ArgumentTypeError(f"expected http://HOST:PORT/metadata, got {text!r}")
    return text


def add_options(group) -> None:
    group.add_argument("--mooncake-master", metavar="HOST:PORT", type=_master,
                       help="use this master (and its segment holder) instead of starting one for the run")
    group.add_argument("--mooncake-metadata", metavar="URL", type=_metadata_url,
                       help="that master's metadata server (default http://HOST:8080/metadata)")


@contextlib.contextmanager
def open_session(options: dict, *, capacity_bytes: int | None = None, cold: bool = False) -> Iterator[dict]:
    """The master and metadata server every rank connects to; a private pair when none is given."""
    master, metadata_url = options.get("mooncake_master"), options.get("mooncake_metadata")
    if metadata_url and not master:
        raise UsageError(f"--mooncake-metadata {metadata_url} needs --mooncake-master")
    if importlib.util.find_spec("mooncake") is None:
        raise UsageError(NEEDS_EXTRA)
    if master:
        metadata_url = metadata_url or default_metadata_url(master)
        check_reachable(master, metadata_url)   # one clear error, before any rank
        yield {"master": master, "metadata_url": metadata_url}
        return
    with MooncakeMaster() as own:
        yield {"master": own.address, "metadata_url": own.metadata_url}
