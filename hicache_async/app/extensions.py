"""What installed packages add to the application, found by entry point as vLLM finds our
connector, so the core's CLI names no engine:
- `hicache_async.bench`: a bench group's name -> `group(quick) -> list of figures`;
- `hicache_async.commands`: a command's name -> its `Command`.

A group or command whose engine is not installed raises `EngineMissing`, naming the extra.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

BENCH_GROUPS = "hicache_async.bench"
COMMANDS = "hicache_async.commands"


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, its flags, and what it runs (an exit code)."""
    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def installed(group: str) -> dict[str, EntryPoint]:
    """The entry points of `group`, by name, in name order (the same on every machine)."""
    return {ep.name: ep for ep in sorted(entry_points(group=group), key=lambda ep: ep.name)}
