"""The unbounded-cache oracle request by request: the prompt tokens each one could reuse.

`oracle.unbounded_oracle` gives the total; the ideal cache's TTFT and the loss account need
it per request. Worked out from the trace's block ids alone, with no hashing and none of the
code of the cache or of that total, which it must add up to: a full page is named by its
tenant's `cache_salt` (if the trace gives one), the chain of block ids up to its block and its
place in that block, which together fix its tokens and all tokens before it. As for the total,
a request reuses the leading run of its full pages (before its last token) that an earlier
prompt held.
"""
from __future__ import annotations

from ...engine.replay.trace import BLOCK_TOKENS, TraceRequest


def reusable_tokens(trace: list[TraceRequest], page_size: int) -> dict[int, int]:
    """Request id (trace line) -> prompt tokens an unbounded cache serves it, in arrival order."""
    per_block = BLOCK_TOKENS // page_size
    chains: dict[tuple, int] = {}          # (chain before, block id) -> chain id; roots by salt
    seen: set[tuple[int, int]] = set()     # (chain id of its block, page within the block)
    out: dict[int, int] = {}
    for req in trace:
        chain = chains.setdefault(("salt", getattr(req, "cache_salt", None)), len(chains))
        pages = []
        for page in range(req.input_length // page_size):
            block, within = divmod(page, per_block)
            if within == 0:
                chain = chains.setdefault((chain, req.hash_ids[block]), len(chains))
            pages.append((chain, within))
        usable, run = (req.input_length - 1) // page_size, 0
        while run < usable and pages[run] in seen:
            run += 1
        out[req.line] = run * page_size
        seen.update(pages)
    return out
