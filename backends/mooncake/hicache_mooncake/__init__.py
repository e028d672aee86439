"""Mooncake store backend for hicache-async, registered as storage `mooncake`.

Names are imported on first use, so `python -m hicache_mooncake.holder` starts without torch.
"""
from __future__ import annotations

__all__ = ["MooncakeMaster", "MooncakeStorage"]


def __getattr__(name: str):
    if name == "MooncakeStorage":
        from .adapter import MooncakeStorage
        return MooncakeStorage
    if name == "MooncakeMaster":
        from .master import MooncakeMaster
        return MooncakeMaster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
