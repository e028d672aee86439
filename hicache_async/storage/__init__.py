"""L3 storage: the adapter protocol, the stored object format, and the built-in backends."""
from .base import MISSING, WRONG_SIZE, StorageAdapter, open_storage

__all__ = ["MISSING", "WRONG_SIZE", "StorageAdapter", "open_storage"]
