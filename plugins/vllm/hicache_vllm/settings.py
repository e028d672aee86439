"""`kv_connector_extra_config`: the CLI's flags as keys, checked once at start-up.

A key or value we do not know stops the engine with one line naming it: a typo that left the
cache silently off (or writing to the wrong place) would cost a user hours.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from hicache_async.config import KEY_SCHEMES, WRITE_POLICIES, CacheConfig
from hicache_async.errors import UsageError
from hicache_async.storage.base import DEFAULT_STORAGE, storage_names

DEFAULT_HOST_PAGES = 256
L3_READS = ("auto", "always", "never")    # read a prefix from L3: when it beats recomputing, always, never


@dataclass(frozen=True)
class Settings:
    storage: str = DEFAULT_STORAGE            # an L3 backend, or "none": the host tier alone
    storage_path: str | None = None           # file storage directory (default: a per-user cache)
    mooncake_master: str | None = None        # HOST:PORT of a running master (default: a private one)
    storage_secret_file: str | None = None    # seal every object with the key derived from this file
    storage_optional: bool = True             # an unreachable L3 at start: warn, serve from the host tier
    host_pages: int = DEFAULT_HOST_PAGES      # host-tier size, in vLLM blocks
    key_scheme: str = "rank-suffix"
    head_group: int = 1                       # kv heads an object holds (unified keys)
    write_policy: str = "write_through"
    storage_timeout: float = 2.0              # seconds an L3 call may take before it is a miss
    flush_timeout: float = 30.0               # seconds shutdown waits for issued backups
    prefetch_min_pages: int = 1               # shorter L3 runs are recomputed, not fetched
    l3_reads: str = "auto"                    # auto: only a run whose read beats recomputing it
    model_id: str | None = None               # names the model in keys (default: vLLM's model)
    late_copies: bool = False                 # for tests: copies reported landed a step late, as on a GPU
    simulated_device: int | None = None      # for tests: CPU KV copied on a simulated device of this seed
    extra: dict = field(default_factory=dict, compare=False)   # other keys of the chosen backend

    def cache_config(self) -> CacheConfig:
        """The core's knobs for the guarded store (deadlines, breaker, key scheme)."""
        return CacheConfig(key_scheme=self.key_scheme, write_policy=self.write_policy,
                           storage_timeout_s=self.storage_timeout, page_size=1)

    def storage_options(self) -> dict:
        """The backend's own options, as its `open_session` takes them."""
        opts = {"storage_path": self.storage_path, "mooncake_master": self.mooncake_master, **self.extra}
        return {k: v for k, v in opts.items() if v is not None}


_TYPES = {"storage_path": str, "mooncake_master": str, "storage_secret_file": str, "model_id": str,
          "host_pages": int, "head_group": int, "prefetch_min_pages": int,
          "storage_timeout": float, "flush_timeout": float, "storage_optional": bool,
          "late_copies": bool, "simulated_device": int}
_BACKEND_KEYS = {"file": {"storage_path"}, "mooncake": {"mooncake_master", "mooncake_metadata"}}


def parse(extra: dict | None) -> Settings:
    """Settings from vLLM's `kv_connector_extra_config`; keys may use - or _."""
    given = {str(k).replace("-", "_"): v for k, v in (extra or {}).items()}
    known = {f.name for f in fields(Settings)} - {"extra"}
    backend_keys = {k for keys in _BACKEND_KEYS.values() for k in keys}
    for key in given:
        if key not in known | backend_keys:
            raise UsageError(f"kv_connector_extra_config: unknown key {key!r}; known keys are "
                             f"{', '.join(sorted(known | backend_keys))}")
    values, extra_opts = {}, {}
    for key, value in given.items():
        if key in known:
            values[key] = _typed(key, value)
        else:
            extra_opts[key] = value
    settings = Settings(**values, extra=extra_opts)
    _check(settings, given)
    return settings


def _typed(key: str, value):
    want = _TYPES.get(key, str)
    if want is bool and not isinstance(value, bool):
        raise UsageError(f"kv_connector_extra_config: {key} must be true or false, got {value!r}")
    if want is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise UsageError(f"kv_connector_extra_config: {key} must be a positive integer, got {value!r}")
    if want is float and (isinstance(value, bool) or not isinstance(value, (int, float))
                          or not 0 < value < float("inf")):
        raise UsageError(f"kv_connector_extra_config: {key} must be a positive number, got {value!r}")
    if want is str and (not isinstance(value, str) or not value):
        raise UsageError(f"kv_connector_extra_config: {key} must be a non-empty string, got {value!r}")
    return float(value) if want is float else value


def _check(s: Settings, given: dict) -> None:
    backends = storage_names()
    if s.storage not in (*backends, "none"):
        raise UsageError(f"kv_connector_extra_config: unknown storage {s.storage!r}; expected one of "
                         f"{', '.join([*backends, 'none'])}")
    if s.key_scheme not in KEY_SCHEMES:
        raise UsageError(f"kv_connector_extra_config: unknown key_scheme {s.key_scheme!r}; expected one of "
                         f"{', '.join(KEY_SCHEMES)}")
    if s.l3_reads not in L3_READS:
        raise UsageError(f"kv_connector_extra_config: unknown l3_reads {s.l3_reads!r}; expected one of "
                         f"{', '.join(L3_READS)}")
    if s.write_policy not in WRITE_POLICIES:
        raise UsageError(f"kv_connector_extra_config: unknown write_policy {s.write_policy!r}; expected one "
                         f"of {', '.join(WRITE_POLICIES)}")
    for backend, keys in _BACKEND_KEYS.items():
        for key in keys & given.keys():
            if s.storage != backend:
                raise UsageError(f"kv_connector_extra_config: {key} needs storage {backend!r}, "
                                 f"not {s.storage!r}")
    if s.storage_secret_file and s.storage == "none":
        raise UsageError(f"kv_connector_extra_config: storage_secret_file {s.storage_secret_file} needs a "
                         f"storage to seal")
