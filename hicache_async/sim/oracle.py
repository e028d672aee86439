"""The unbounded-cache oracle: the prompt tokens a cache that never evicts could have served.

Computed from the trace alone, with none of the cache's code (its page hashes included), so
it can judge the cache: requests in arrival order; each reuses the leading run of its full
pages that some earlier prompt of the same tenant held (over prompt[:-1], since the last
prompt token is always computed for its logits), then its own full pages join the set. A
page is known by the trace's name for it (`replay_trace.prompt_page_ids`: tenant, block ids
up to its block, offset). A page counts as cached from the moment the earlier request
arrived, so the oracle bounds the real cache from above: the gap is reuse a cache cannot
have, e.g. a request arriving while its prefix is still being computed.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engine.replay_trace import TraceRequest, prompt_page_ids


@dataclass(frozen=True)
class Oracle:
    tokens: int            # prompt tokens an unbounded cache serves
    distinct_pages: int    # full prompt pages of the whole trace, each counted once


def unbounded_oracle(trace: list[TraceRequest], page_size: int, seed: int = 0) -> Oracle:
    seen: set[int] = set()
    hits = 0
    for req in trace:
        pages = prompt_page_ids(req, page_size, seed).tolist()
        usable = (req.input_length - 1) // page_size
        run = 0
        while run < usable and pages[run] in seen:
            run += 1
        hits += run * page_size
        seen.update(pages)
    return Oracle(hits, len(seen))
