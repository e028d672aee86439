"""L3 storage: the adapter protocol, the stored object format, and the built-in backends."""
from .base import FORGED, MISSING, WRONG_SIZE, StorageAdapter, open_storage

__all__ = ["FORGED", "MISSING", "WRONG_SIZE", "StorageAdapter", "open_storage"]
