"""Whether a run of pages the host tier lacks is read from L3 or computed (`l3_reads`).

Under auto a run is read only where the read is expected to finish before computing it would:
the cost model (`prefetch_cost.py`) learns an L3 read's latency and time a page from the
workers' timed reads, and a token's prefill from their timed forward passes, both carried in
their reports; now and then a run it would recompute is read anyway, to learn from.
"""
from __future__ import annotations

from hicache_async.hicache.prefetch_cost import PrefetchCost

from .plan import JobReports
from .settings import Settings

PROBE_EVERY = 8         # runs in a row the cost model would recompute: the next is read, to learn from


class L3Reads:
    def __init__(self, settings: Settings, page_size: int, page_bytes: int, counts: dict[str, int]) -> None:
        """`counts`: the scheduler's, where the pages of runs declined are counted."""
        self.settings, self.page_size, self.counts = settings, page_size, counts
        prior = settings.cache_config()     # the core's figures, until timed reads and passes replace them
        self.cost = PrefetchCost.learned(page_bytes, page_size, prefill_us_per_token=prior.prefill_us_per_token,
                                         l3_gbps=prior.l3_gbps, l3_latency_us=prior.l3_latency_us,
                                         probe_every=PROBE_EVERY)

    def pays(self, pages: int) -> bool:
        """Whether to read a run of `pages` from L3: under auto, where the cost model expects the
        read to finish before their prefill would (or probes)."""
        if self.settings.l3_reads != "auto":
            return self.settings.l3_reads == "always"
        if self.cost.decide(pages, pages * self.page_size).fetch:
            return True
        self.counts["l3_declined_pages"] += pages
        return False

    def learn(self, reports: JobReports) -> None:
        """From the workers' timed reads and forward passes."""
        for pages, seconds in reports.reads:
            self.cost.observe_read(pages, seconds)
        for tokens, seconds in reports.passes:
            self.cost.observe_prefill(tokens, seconds)

    def estimates(self) -> dict:
        """The cost model's estimates, for the stats (gauges)."""
        cost = self.cost
        return {"l3_read_latency_seconds": {"scheduler": cost.latency_s},
                "l3_read_seconds_per_page": {"scheduler": cost.page_read_s},
                "prefill_seconds_per_token": {"scheduler": cost.prefill_s}}
