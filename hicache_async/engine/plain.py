"""The cache-less KV plugin: pages per request, nothing reused. The reference run uses it."""
from __future__ import annotations

from ..errors import PoolExhausted
from ..api import EngineContext, KVPlugin
from ..request import Request


class PlainKV(KVPlugin):
    def __init__(self, **_options) -> None:
        self.prompt_tokens = 0

    def attach(self, engine: EngineContext) -> None:
        self.device = engine.device
        self.page_size = engine.layout.page_size

    def admit(self, req: Request) -> bool:
        need = req.pages_needed(self.page_size)
        if need > self.device.alloc.num_pages:
            raise PoolExhausted(f"request {req.id} needs {need} device pages, the pool has "
                                f"{self.device.alloc.num_pages}")
        if need > self.device.alloc.free:
            return False
        req.pages = self.device.alloc.alloc(need)
        self.prompt_tokens += len(req.prompt)
        return True

    def finish(self, req: Request) -> None:
        self.device.alloc.release(req.pages)
        req.pages = []

    def report(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "tokens_computed": self.prompt_tokens}
