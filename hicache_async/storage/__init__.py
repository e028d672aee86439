"""L3 byte backends: the adapter protocol and registry, the built-in memory and file backends,
and the wrappers every backend runs behind (sealing, deadlines and a breaker, tracing)."""
from .base import FORGED, MISSING, WRONG_SIZE, StorageAdapter, open_storage, storage_names
from .file import FileStorage
from .memory import MemoryStorage
from .sealed import SealedStorage

__all__ = ["FORGED", "MISSING", "WRONG_SIZE", "FileStorage", "MemoryStorage", "SealedStorage", "StorageAdapter",
           "open_storage", "storage_names"]
