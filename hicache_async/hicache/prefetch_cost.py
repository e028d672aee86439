"""Whether an L3 prefetch pays: fetching the missing pages against recomputing their tokens.

A fixed token threshold (the anchor's 256) leaves L3 written and never read on short prompts,
and fetches too eagerly where L3 is slow. Here a prefetch is issued when

    latency + pages x page bytes / bandwidth  <  tokens x prefill cost per token.

Every rank must decide alike, so the inputs are either configured (prefill cost, latency) or
agreed: each rank offers the throughput of the prefetches it completed, the step message
carries the MIN (the slowest rank bounds a prefetch), and every rank folds that same number
into the same running estimate at the same step. Page bytes are a rank's share of the
model's page, worked out from global figures so that it is the same on every rank. Under a
modelled clock (a replay) the clock times a fetch as it will time the prefetch, the same on
every rank, and nothing is measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..clock import OpClock
from ..kinds import TransferKind
from ..layout import KVLayout
from ..parallel.agreement import NOT_READY
from ..topology import RankCoords

SMOOTHING = 0.5       # weight of a new agreed sample in the running estimate


@dataclass(frozen=True)
class Decision:
    fetch: bool
    fetch_s: float
    recompute_s: float

    def attributes(self) -> dict[str, object]:
        return {"hicache.prefetch.decision": "fetch" if self.fetch else "recompute",
                "hicache.prefetch.fetch_s": self.fetch_s, "hicache.prefetch.recompute_s": self.recompute_s}


class PrefetchCost:
    def __init__(self, layout: KVLayout, coords: RankCoords, *, prefill_us_per_token: float,
                 l3_gbps: float, l3_latency_us: float, threshold_tokens: int | None = None,
                 clock: OpClock | None = None) -> None:
        self.clock = clock or OpClock()
        # Per-rank bytes of a page from global figures only: TP splits the heads (replicating
        # each above their number; MLA's one latent is never split), PP the layers.
        heads = layout.total_kv_heads / min(coords.tp_size, layout.total_kv_heads)
        self.page_bytes = (layout.layer_page_bytes / layout.kv_heads * heads
                           * layout.total_layers / coords.pp_size)
        self.threshold_tokens, self.page_size = threshold_tokens, layout.page_size
        self.prefill_s = prefill_us_per_token * 1e-6
        self.latency_s = l3_latency_us * 1e-6
        self.bytes_per_s = l3_gbps * 1e9
        self._offer = NOT_READY

    def decide(self, pages: int, tokens: int) -> Decision:
        """Fetch when it beats recomputing; an explicit token threshold overrides the rule (the
        costs are still worked out, for the spans)."""
        fetch_s = self.clock.transfer_s(TransferKind.PREFETCH, pages)
        if fetch_s is None:
            fetch_s = self.latency_s + pages * self.page_bytes / self.bytes_per_s
        recompute_s = tokens * self.prefill_s
        if self.threshold_tokens is not None:
            return Decision(tokens >= max(self.threshold_tokens, self.page_size), fetch_s, recompute_s)
        return Decision(fetch_s < recompute_s, fetch_s, recompute_s)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A prefetch this rank completed: offer its throughput (KB/s) at the next agreement
        (none under a modelled clock: its wall time says nothing about the modelled link)."""
        if nbytes and seconds > 0 and not self.clock.modelled:
            self._offer = min(self._offer, int(nbytes / seconds / 1e3))

    def offer(self) -> int:
        """This rank's sample for the step message; taken once."""
        offer, self._offer = self._offer, NOT_READY
        return offer

    def agreed(self, kbps: int) -> None:
        """Fold the step's agreed sample into the estimate, identically on every rank."""
        if kbps < NOT_READY:
            self.bytes_per_s += SMOOTHING * (max(kbps, 1) * 1e3 - self.bytes_per_s)
