"""The backend's extra config: SGLang's JSON object, read as the CLI's flags would be.

Keys mirror `hicache-async simulate` flags with underscores (`storage_path` is `--storage-path`);
a backend's own flags (`mooncake_master` ...) come from that backend's `add_options`, so an
installed third-party backend brings its keys as it brings its flags. A bad key or value is a
`UsageError` naming it, raised while SGLang builds the backend, so SGLang refuses to start
instead of running without L3.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from hicache_async.config import CacheConfig
from hicache_async.errors import UsageError
from hicache_async.storage.base import DEFAULT_STORAGE, storage_backend

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
"""Keys SGLang itself reads from the same object (the `dynamic` loader, the v1 switch, heterogeneous TP)."""


@dataclass(frozen=True)
class Options:
    storage: str = DEFAULT_STORAGE
    backend_options: dict = field(default_factory=dict)   # the backend's own flags, by dest
    secret_file: str | None = None
    key_scheme: str = "rank-suffix"
    storage_timeout: float = 2.0
    cp_transfer: str = "split"
    head_group: int | None = None   # unified keys: kv heads an object holds (default: tp_lcm_size's split)
    kv_heads: int | None = None     # the model's kv heads, where a rank's one head may be a replica
    model_id: str | None = None     # overrides SGLang's model name in the namespace

    def cache_config(self) -> CacheConfig:
        return CacheConfig(key_scheme=self.key_scheme, storage_timeout_s=self.storage_timeout,
                           cp_transfer=self.cp_transfer)


def _positive(kind):
    def parse(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf \
                or (kind is int and value != int(value)):
            raise ValueError
        return kind(value)
    return parse


def _text(value):
    if not isinstance(value, str) or not value:
        raise ValueError
    return value


_OURS = {
    "storage": _text, "storage_secret_file": _text, "key_scheme": _text, "cp_transfer": _text,
    "storage_timeout": _positive(float), "head_group": _positive(int), "kv_heads": _positive(int),
    "model_id": _text,
}


class _Flags:
    """Collects a backend's `add_options` flags as (dest, parse) pairs instead of argparse actions."""

    def __init__(self) -> None:
        self.parsers = {}

    def add_argument(self, *flags, **kwargs) -> None:
        dest = kwargs.get("dest") or flags[0].lstrip("-").replace("-", "_")
        self.parsers[dest] = kwargs.get("type") or _text


def backend_keys(name: str) -> dict:
    """The backend's own keys and how each value is parsed."""
    flags = _Flags()
    storage_backend(name).add_options(flags)
    return flags.parsers


def parse_options(extra: dict | None) -> Options:
    """Options from SGLang's `extra_config`; one line naming the first bad key or value."""
    extra = dict(extra or {})
    name = _value("storage", extra.get("storage", DEFAULT_STORAGE), _text)
    own = backend_keys(name)
    values, backend = {}, {}
    for key, raw in extra.items():
        if key in SGLANG_KEYS:
            continue
        if key in _OURS:
            values[key] = _value(key, raw, _OURS[key])
        elif key in own:
            backend[key] = _value(key, raw, own[key])
        else:
            known = ", ".join(sorted({*_OURS, *own}))
            raise UsageError(f"hicache-async extra config: unknown key {key!r} (storage {name}): expected {known}")
    values.pop("storage", None)
    options = Options(storage=name, backend_options=backend, secret_file=values.pop("storage_secret_file", None),
                      **values)
    options.cache_config()   # validates key_scheme and cp_transfer, naming them
    return options


def _value(key: str, raw, parse):
    try:
        return parse(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError, UsageError) as exc:
        why = f": {exc}" if str(exc) else ""
        raise UsageError(f"hicache-async extra config: bad {key} {raw!r}{why}") from None
