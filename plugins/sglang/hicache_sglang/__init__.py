"""hicache-async as an SGLang HiCache storage backend (`--hicache-storage-backend dynamic`, or
by name once `register` has run from SGLang's `sglang.srt.plugins` entry point). The backend,
which imports SGLang, is imported when asked for: the bench group loads without SGLang."""

__all__ = ["HiCacheAsyncStorage"]


def __getattr__(name: str):
    if name == "HiCacheAsyncStorage":
        from .storage import HiCacheAsyncStorage
        return HiCacheAsyncStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
