"""The worker side: the threads and streams that move pages (the copier between the pools, the
page store between the host pool and storage), the stored object format and its checksums."""
from .copier import Copier, CopyFailed
from .page_store import PageStore

__all__ = ["Copier", "CopyFailed", "PageStore"]
