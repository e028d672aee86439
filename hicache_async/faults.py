"""Fault injection, for testing that the checks catch what they claim to catch.

`HICACHE_ASYNC_FAULT` (unset by default) names one fault, injected where the data moves:
- `swap-load-pages`: an L2 -> L1 load puts its first two pages in each other's device slots;
- `noise-load`: an L2 -> L1 load adds 1e-3 relative noise to the pages it delivers (the
  CPU's copies: `simulate` runs its pools there);
- `corrupt-stored`: a backup stores wrong bytes under a valid checksum (a writer bug, which
  only the KV check can see);
- `copy-error`: the first L1 -> L2 write fails;
- `unchained-hash`: page hashes drop their chain (`keys.page_digests`), so equal pages after
  different prefixes share a storage key.
"""
from __future__ import annotations

import os

from .errors import UsageError

ENV = "HICACHE_ASYNC_FAULT"
FAULTS = ("swap-load-pages", "noise-load", "corrupt-stored", "copy-error", "unchained-hash")


def injected() -> str | None:
    """The fault named in the environment, or None; an unknown name is a usage error."""
    name = os.environ.get(ENV) or None
    if name is not None and name not in FAULTS:
        raise UsageError(f"unknown {ENV}={name!r}: expected one of {', '.join(FAULTS)}")
    return name
