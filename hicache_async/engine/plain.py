"""The cache-less KV plugin: pages per request, nothing reused. The reference run uses it."""
from __future__ import annotations

from ..api import EngineContext, KVPlugin
from ..errors import PoolExhausted
from ..request import Request


class PlainKV(KVPlugin):
    def __init__(self, **_options) -> None:
        self.prompt_tokens = 0

    def attach(self, engine: EngineContext) -> None:
        self.free_pages = engine.device.alloc    # with no cache, this plugin hands out every page
        self.page_size = engine.layout.page_size

    def admit(self, req: Request) -> bool:
        need, pages = req.pages_needed(self.page_size), self.free_pages
        if need > pages.num_pages:
            raise PoolExhausted(f"request {req.id} needs {need} device pages, the pool has {pages.num_pages}")
        if need > pages.free:
            return False
        req.pages = pages.alloc(need)
        self.prompt_tokens += len(req.prompt)
        return True

    def finish(self, req: Request) -> None:
        self.free_pages.release(req.pages)
        req.pages = []

    def report(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "tokens_computed": self.prompt_tokens}
