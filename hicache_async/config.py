"""Cache policies and knobs, validated once so bad values fail early with one line."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import UsageError

_CPUS = os.cpu_count() or 1
CHECKSUM_WORKERS = min(3, _CPUS - 1) if _CPUS >= 4 else 0
"""Cores a stored object's checksum (or seal) may take beside its transfer: none on a machine
with fewer than four, where it runs inline while the bytes are in cache. Backends read it to
size their calls, the transfer side to size its pool."""

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
KEY_SCHEMES = ("rank-suffix", "unified")
CP_MODES = ("split", "rank0")      # CP ranks split the writing, or only CP rank 0 transfers


@dataclass(frozen=True)
class CacheConfig:
    device_pages: int = 64
    host_pages: int = 256
    page_size: int = 16
    write_policy: str = "write_through"
    load_back_threshold: int = 1          # pages: shorter host hits are recomputed instead
    prefetch_policy: str = "timeout"
    prefetch_threshold: int | None = None  # tokens: an explicit cut-off overriding the cost rule
    prefill_us_per_token: float = 50.0    # the engine's prefill cost, for the prefetch cost rule
    l3_gbps: float = 1.0                  # L3 throughput assumed until prefetches measure it
    l3_latency_us: float = 1000.0         # fixed cost of one prefetch (probe, call, commit)
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_1k_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    key_scheme: str = "rank-suffix"
    cp_transfer: str = "split"            # "split" or "rank0"
    storage_workers: int = 2              # threads per kind of L3 op (backups, prefetches)
    storage_timeout_s: float = 2.0        # an L3 call still running after this is a storage error
    storage_breaker_failures: int = 3     # consecutive failed L3 calls that make later ones fail fast
    storage_retry_s: float = 1.0          # how often a failing-fast storage is probed again
    sync_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("device_pages", "host_pages", "page_size", "load_back_threshold",
                     "storage_workers", "storage_timeout_s", "storage_breaker_failures", "storage_retry_s",
                     "l3_gbps"):
            if getattr(self, name) <= 0:
                raise UsageError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.prefetch_threshold is not None and self.prefetch_threshold < 0:
            raise UsageError(f"prefetch-threshold must be >= 0, got {self.prefetch_threshold}")
        for name in ("prefill_us_per_token", "l3_gbps", "l3_latency_us"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise UsageError(f"{name.replace('_', '-')} must be a finite number >= 0, got {getattr(self, name)}")
        for name, allowed in (("write_policy", WRITE_POLICIES), ("prefetch_policy", PREFETCH_POLICIES),
                              ("key_scheme", KEY_SCHEMES), ("cp_transfer", CP_MODES)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"unknown {name.replace('_', '-')} {getattr(self, name)!r}: "
                                 f"expected one of {', '.join(allowed)}")

    def prefetch_timeout(self, tokens: int) -> float:
        return min(self.prefetch_timeout_max_s,
                   self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * tokens / 1024)
