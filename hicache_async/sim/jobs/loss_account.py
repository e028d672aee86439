"""Where the reuse went: why each prompt token the unbounded oracle could reuse was computed.

A request's loss is what the oracle says it could reuse minus what the cache served it;
the cache names why the page after its served prefix was not served (every later page of
the prefix is lost with it), and all of the request's loss is booked under that reason.
The account adds up to `oracle_tokens - hits` exactly, or the run is wrong.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from ...engine.replay.trace import TraceRequest
from ...errors import HiCacheError

EARLIER = "reused_from_before_the_run"


def lost_tokens(trace: Sequence[TraceRequest], reusable: Mapping[int, int], served: Sequence[int],
                reasons: Mapping[str, str], earlier_tokens: int = 0) -> dict[str, int]:
    """Reason -> tokens, largest first. `served` is each request's cached prompt tokens in the
    trace's order; `reasons` the cache's reason for each request it served short, by id.

    An L3 that held pages before the run (a `--storage-path` an earlier run filled) can serve
    more than the oracle, which starts empty: up to `earlier_tokens`, the tokens of the pages
    the cache fetched that this run never cached. That gain is booked as a negative loss,
    `EARLIER`, so the account still adds up; any more is a bug."""
    lost: Counter[str] = Counter()
    for req, got in zip(trace, served, strict=True):
        could = reusable[req.line]
        if got > could:
            lost[EARLIER] -= got - could
            if -lost[EARLIER] > earlier_tokens:
                raise HiCacheError(f"request {req.line}: the cache served {got} prompt tokens, more than the "
                                   f"{could} an unbounded cache could, and L3 held no such pages from before "
                                   f"the run: the oracle or the cache is wrong")
        elif got < could:
            reason = reasons.get(str(req.line))
            if reason is None:
                raise HiCacheError(f"request {req.line}: {could - got} reusable prompt tokens were computed "
                                   f"and the cache named no reason")
            lost[reason] += could - got
    return dict(sorted(lost.items(), key=lambda kv: -abs(kv[1])))


def check_account(lost: Mapping[str, int], oracle_tokens: int, hits: int) -> None:
    """The account must add up: every reusable token was served or lost for one reason."""
    if sum(lost.values()) != oracle_tokens - hits:
        raise HiCacheError(f"the loss account does not add up: {sum(lost.values()):,} tokens lost, but the "
                           f"oracle's {oracle_tokens:,} minus the {hits:,} served is {oracle_tokens - hits:,}")
