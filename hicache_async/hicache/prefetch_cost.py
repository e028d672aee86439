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

A single decider that times its own reads and prefills (vLLM's scheduler, over its workers'
reports) learns the latency and prefill cost too: `observe_read` and `observe_prefill` fit a
line through recent samples (`LineFit`), the configured figures its prior. A decision against
fetching every `probe_every`-th time in a row is a fetch all the same, and so is the next after
a read that beat recomputing, so a store that became fast again is read and the estimate
learns it within a few reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..clock import OpClock
from ..kinds import TransferKind
from ..layout import KVLayout
from ..parallel.agreement import NOT_READY
from ..topology import RankCoords

SMOOTHING = 0.5       # weight of a new agreed sample in the running estimate
PRIOR_DECAY, PRIOR_FLOOR = 0.5, 0.01   # a line fit's prior: its weight a sample on, and its least


class LineFit:
    """y = intercept + slope * x by least squares over exponentially forgotten samples (each new
    one weighs 1, older ones `forget` times less a sample), the slope drawn towards the prior's
    as strongly as samples spread over a sixteenth of `span` (the x the prior is for) would
    pull it, fading by `PRIOR_DECAY` a sample down to `PRIOR_FLOOR`: a few samples move it,
    and samples all at one x keep the prior's slope and pass through their mean, so the
    estimate is right where the samples are."""

    def __init__(self, intercept: float, slope: float, span: float, forget: float) -> None:
        self.intercept, self.slope, self.prior_slope = intercept, slope, slope
        self.strength, self.prior_weight = (span / 16) ** 2, 1.0
        self.forget = forget
        self._sums = [0.0] * 5     # weight, x, y, xx, xy

    def add(self, x: float, y: float) -> None:
        self._sums = [v * self.forget for v in self._sums]
        self.prior_weight = max(PRIOR_FLOOR, self.prior_weight * PRIOR_DECAY)
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += v
        w, sx, sy, sxx, sxy = self._sums
        mx, my = sx / w, sy / w
        k = self.strength * self.prior_weight
        slope = (sxy / w - mx * my + k * self.prior_slope) / (max(sxx / w - mx * mx, 0.0) + k)
        self.slope = max(slope, 0.0)
        self.intercept = max(my - self.slope * mx, 0.0)


@dataclass(frozen=True)
class Decision:
    fetch: bool
    fetch_s: float
    recompute_s: float
    probe: bool = False      # fetched to teach the estimate, against the rule

    def attributes(self) -> dict[str, object]:
        decision = "probe" if self.probe else "fetch" if self.fetch else "recompute"
        return {"hicache.prefetch.decision": decision,
                "hicache.prefetch.fetch_s": self.fetch_s, "hicache.prefetch.recompute_s": self.recompute_s}


class PrefetchCost:
    def __init__(self, layout: KVLayout, coords: RankCoords, *, prefill_us_per_token: float,
                 l3_gbps: float, l3_latency_us: float, threshold_tokens: int | None = None,
                 clock: OpClock | None = None) -> None:
        # Per-rank bytes of a page from global figures only: TP splits the heads (replicating
        # each above their number; MLA's one latent is never split), PP the layers.
        heads = layout.total_kv_heads / min(coords.tp_size, layout.total_kv_heads)
        self._setup(layout.layer_page_bytes / layout.kv_heads * heads * layout.total_layers / coords.pp_size,
                    layout.page_size, prefill_us_per_token, l3_gbps, l3_latency_us, threshold_tokens, clock)

    @classmethod
    def learned(cls, page_bytes: float, page_size: int, *, prefill_us_per_token: float, l3_gbps: float,
                l3_latency_us: float, probe_every: int) -> "PrefetchCost":
        """A decider that learns from its own timed reads and prefills, the figures its prior."""
        cost = cls.__new__(cls)
        cost._setup(page_bytes, page_size, prefill_us_per_token, l3_gbps, l3_latency_us, None, None)
        cost.probe_every = probe_every
        return cost

    def _setup(self, page_bytes: float, page_size: int, prefill_us_per_token: float, l3_gbps: float,
               l3_latency_us: float, threshold_tokens: int | None, clock: OpClock | None) -> None:
        self.clock = clock or OpClock()
        self.page_bytes, self.page_size, self.threshold_tokens = page_bytes, page_size, threshold_tokens
        self.prefill_s = prefill_us_per_token * 1e-6
        self.latency_s = l3_latency_us * 1e-6
        self.bytes_per_s = l3_gbps * 1e9
        self.probe_every, self._declined = 0, 0
        self._offer = NOT_READY
        self._reads = LineFit(self.latency_s, page_bytes / self.bytes_per_s, span=64, forget=0.7)
        self._prefills = LineFit(0.0, self.prefill_s, span=2048, forget=0.95)

    def decide(self, pages: int, tokens: int) -> Decision:
        """Fetch when it beats recomputing; an explicit token threshold overrides the rule (the
        costs are still worked out, for the spans)."""
        fetch_s = self.clock.transfer_s(TransferKind.PREFETCH, pages)
        if fetch_s is None:
            fetch_s = self.latency_s + pages * self.page_bytes / self.bytes_per_s
        recompute_s = tokens * self.prefill_s
        if self.threshold_tokens is not None:
            return Decision(tokens >= max(self.threshold_tokens, self.page_size), fetch_s, recompute_s)
        if fetch_s < recompute_s:
            self._declined = 0
            return Decision(True, fetch_s, recompute_s)
        self._declined += 1
        if self.probe_every and self._declined >= self.probe_every:
            self._declined = 0
            return Decision(True, fetch_s, recompute_s, probe=True)
        return Decision(False, fetch_s, recompute_s)

    def observe_read(self, pages: int, seconds: float) -> None:
        """A timed L3 read of `pages`: the latency is the fit's intercept, a page's time its slope.
        A read that beat recomputing its tokens makes the next decision against fetching a probe
        too, so a store that became fast is read until the estimate says so."""
        if pages > 0 and seconds > 0:
            if self.probe_every and seconds < pages * self.page_size * self.prefill_s:
                self._declined = max(self._declined, self.probe_every - 1)
            self._reads.add(pages, seconds)
            self.latency_s = self._reads.intercept
            self.bytes_per_s = self.page_bytes / max(self._reads.slope, 1e-12)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A timed forward pass over `tokens`: a token's prefill cost is the fit's slope (the
        pass's fixed cost, its intercept, is paid whether a prefix is fetched or not)."""
        if tokens > 0 and seconds > 0:
            self._prefills.add(tokens, seconds)
            self.prefill_s = self._prefills.slope

    @property
    def page_read_s(self) -> float:
        """Seconds a page adds to a read."""
        return self.page_bytes / self.bytes_per_s

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
