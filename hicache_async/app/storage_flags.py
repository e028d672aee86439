"""`--storage` and every installed backend's own flags (`StorageAdapter.add_options`), so the
CLI names no backend: one a third party installs brings its flags to `--help` by itself."""
from __future__ import annotations

import argparse

from ..errors import UsageError
from ..storage.base import DEFAULT_STORAGE, storage_backend, storage_names


class _BackendFlags:
    """The argument group a backend's `add_options` fills, remembering which flags are its own."""

    def __init__(self, group) -> None:
        self.group, self.actions = group, []

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        self.actions.append(self.group.add_argument(*args, **kwargs))
        return self.actions[-1]


def add_storage_flags(p: argparse.ArgumentParser) -> None:
    """`--storage` and, in a group each, every installed backend's own flags."""
    names = storage_names()
    p.add_argument("--storage", choices=[*names, "none"], default=DEFAULT_STORAGE,
                   help="an L3 backend from the hicache_async.storage entry points, or none")
    owned = {}
    for name in names:
        try:
            backend = storage_backend(name)
        except UsageError:
            continue        # one that cannot load says why if a run names it
        owned[name] = _BackendFlags(p.add_argument_group(f"{name} storage"))
        backend.add_options(owned[name])
    p.set_defaults(storage_flags={name: flags.actions for name, flags in owned.items()})


def storage_options(ns: argparse.Namespace) -> dict:
    """The chosen backend's own flags by dest; one given for another backend is a usage error."""
    for name, actions in ns.storage_flags.items():
        for action in actions:
            value = getattr(ns, action.dest)
            if name != ns.storage and value != action.default:
                raise UsageError(f"{action.option_strings[0]} {value} needs --storage {name}")
    return {action.dest: getattr(ns, action.dest) for action in ns.storage_flags.get(ns.storage, ())}
