"""Mooncake store backend for hicache-async, registered as storage `mooncake`."""
from .adapter import MooncakeStorage
from .master import MooncakeMaster

__all__ = ["MooncakeMaster", "MooncakeStorage"]
