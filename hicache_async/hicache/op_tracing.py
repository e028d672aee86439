"""One rank's cache telemetry: a span per agreed step, a span per admitted request, a span per
transfer from issue to retirement, and the cache metrics.

The step ledger calls `issue` as tiers issue ops and `retired` once every rank agreed an op is
done (`abandoned` for one the plugin's exit cancelled).
"""
from __future__ import annotations

import time

from ..kinds import TransferKind
from ..parallel.topology import RankCoords
from ..request import Request
from ..telemetry import spans
from .ops import CacheOp
from .prefetch_cost import Decision


class OpTracer:
    def __init__(self, run_id: str, coords: RankCoords, key_scheme: str) -> None:
        self.run_id, self.coords, self.key_scheme = run_id, coords, key_scheme
        self.metrics = spans.CacheMetrics()
        self.transfers = {kind.value: 0 for kind in TransferKind}     # retired, by kind
        self.step_span = None

    def begin_step(self, step: int) -> None:
        self.end()
        self.step_span = spans.begin_step(self.run_id, step, self.coords)

    def admission(self, req: Request, device_tokens: int, host_tokens: int, decision: Decision | None) -> None:
        """A `hicache.request` span per rank in the request's own trace: where links lead."""
        if not spans.tracing_enabled():
            return
        attrs = {"hicache.prompt_tokens": len(req.prompt), "hicache.tokens.l1": device_tokens,
                 "hicache.tokens.l2_l3": host_tokens, **(decision.attributes() if decision else {})}
        with spans.request_span(self.run_id, req.id, self.coords, step=self.step_span, attrs=attrs):
            pass

    def issue(self, op: CacheOp, request_ids: list[int]) -> None:
        src, dst = op.kind.route
        links = [spans.request_link(self.run_id, r) for r in request_ids]
        op.span = spans.start_transfer(
            op.kind, pages=op.pages, nbytes=op.nbytes, coords=self.coords,
            key_scheme=self.key_scheme if op.kind.storage else None,
            links=links, parent=self.step_span)

    def retired(self, op: CacheOp, step: int, attrs: dict | None = None) -> None:
        """Count the op and end its span; an L3 op whose objects failed ends `result=error`."""
        result = getattr(op, "result", None)
        error = result if isinstance(result, Exception) else None
        failed = {f"hicache.{name}": getattr(result, name, 0) for name in ("errors", "corrupt", "missing")
                  if result is not None}
        for reason in ("corrupt", "missing"):
            if failed.get(f"hicache.{reason}"):
                self.metrics.bad_objects(reason, failed[f"hicache.{reason}"])
        self.transfers[op.kind.value] += 1
        self.metrics.transfer(op.kind.value, op.nbytes, time.perf_counter() - op.started)
        if op.span is not None:
            outcome = "error" if error is not None or any(failed.values()) else "ok"
            spans.finish_transfer(op.span, result=outcome, error=error,
                                      attrs={"hicache.retired_step": step, **failed, **(attrs or {})})

    def abandoned(self, op: CacheOp) -> None:
        if op.span is not None:
            spans.finish_transfer(op.span, result="cancelled")

    def end(self) -> None:
        if self.step_span is not None:
            self.step_span.end()
            self.step_span = None
