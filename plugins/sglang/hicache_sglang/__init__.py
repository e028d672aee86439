"""hicache-async as an SGLang HiCache storage backend (`--hicache-storage-backend dynamic`, or
by name once `register` has run from SGLang's `sglang.srt.plugins` entry point)."""
from .storage import HiCacheAsyncStorage

__all__ = ["HiCacheAsyncStorage"]
