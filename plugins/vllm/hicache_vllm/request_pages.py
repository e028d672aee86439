"""One request's pages as the scheduler tracks them: their hashes, where its hit came from,
and what is under way for it."""
from __future__ import annotations

from dataclasses import dataclass, field

from .request_keys import RequestKeys


@dataclass
class RequestPages:
    request: object                      # vLLM's Request, live
    hashes: list[str] = field(default_factory=list)
    keyed: bool = True                   # False: something decides its KV that we cannot name
    looked_in_l3: bool = False
    job: int | None = None               # the prefetch it waits for
    load: tuple[int, list[int], tuple] | None = None   # (first page, slots, reader token) to load
    saved: int = 0                       # leading pages already in the host tier or planned
    from_host: int = 0                   # tokens it took from the host tier...
    from_l3: int = 0                     # ...and of those, from L3 through it
    fenced: int = 0                      # preemptions while its saves were in flight (each worker fenced them)
    device: int = 0                      # tokens vLLM's own prefix cache gave it
    start: int = 0                       # the page its hit starts at
    limit: int | None = None             # the furthest page its hit may reach (every group's, `groups.py`)
    unfilled: tuple[int, int] | None = None   # pages vLLM counts loaded that no load fills: recomputed

    def extend(self, keys: RequestKeys) -> bool | None:
        """Hashes for every full page of the request's tokens so far; None while its keys are
        still being made, False when it cannot be keyed."""
        if self.keyed:
            ready = keys.extend(self.request, self.hashes)
            if ready is None:
                return None
            self.keyed = ready
        return self.keyed
