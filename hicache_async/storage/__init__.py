"""L3 byte backends: the adapter protocol and registry, the built-in memory and file backends,
and the wrappers every backend runs behind (deadlines and a breaker, tracing)."""
from .base import MISSING, WRONG_SIZE, StorageAdapter, open_storage, storage_names
from .file import FileStorage
from .memory import MemoryStorage

__all__ = ["MISSING", "WRONG_SIZE", "FileStorage", "MemoryStorage", "StorageAdapter", "open_storage",
           "storage_names"]
