"""KV witnesses: the engine-side proof that cached KV is the KV the engine would compute.

Generated tokens alone are a weak check (a tiny model shrugs off swapped or noisy pages),
so before a forward pass reads a cached page the scheduler hands it to a witness, which
compares its bytes with the truth: a recording of the cache-less reference run, or the
pure function the replay engine writes. The reference run records through the same hook.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..layout import KVLayout
from ..parallel.topology import RankCoords
from ..request import Request


class Truth(Protocol):
    """What a request's cached pages must hold. It names pages its own way, never by the
    cache's page keys: a check that shared them would pass whatever they get wrong."""

    def page_ids(self, req: Request, pages: int) -> Sequence:
        """Names of `req`'s first `pages` pages."""

    def expected(self, page_ids: Sequence, layer: int) -> torch.Tensor:
        """One local layer of those pages: [pages, planes, page_size, heads, dim], shaped and
        placed like the device pool's pages."""


class KVWitness:
    """The scheduler's two calls; a witness overrides the one it needs."""

    def before_read(self, req: Request, layer: int, kv_layer: torch.Tensor, origin: list[str]) -> None:
        """Layer `layer` of `req`'s cached pages is on the device and about to be read."""

    def after_prefill(self, req: Request, kv: torch.Tensor) -> None:
        """`req`'s prompt KV was just computed into its pages."""


class KVCheck(KVWitness):
    """Compares each cached page, layer by layer, with the truth; counts and names mismatches.

    `exact=False` allows one float32 rounding (rtol 1e-6) for truths recorded from a run whose
    float64 math was batched differently; any injected fault is many orders above that.
    """

    def __init__(self, truth: Truth, layout: KVLayout, coords: RankCoords = RankCoords(),
                 exact: bool = True) -> None:
        self.truth, self.layout, self.coords, self.exact = truth, layout, coords, exact
        self.verified_pages = 0
        self.mismatches = 0
        self.first_mismatch: str | None = None
        # request id -> (its cached pages' names, their device page ids, the pages found bad)
        self._open: dict[int, tuple[Sequence, torch.Tensor, set[int]]] = {}

    def before_read(self, req: Request, layer: int, kv_layer: torch.Tensor, origin: list[str]) -> None:
        ps = self.layout.page_size
        n = req.cached // ps
        if not n:
            return
        if req.id not in self._open:
            self._open[req.id] = (self.truth.page_ids(req, n), torch.tensor(req.pages[:n]), set())
        names, pages, bad = self._open[req.id]
        got = kv_layer[pages]
        want = self.truth.expected(names, layer).to(got.dtype)
        if not self._same(got, want):
            close = self._close(got, want).flatten(1).all(dim=1)
            for page in (~close).nonzero().flatten().tolist():
                if page not in bad:      # counted once per page, named at its first bad layer
                    self._mismatch(req, page, layer, origin, float((got[page] - want[page]).abs().max()))
                    bad.add(page)
        if layer == self.layout.num_layers - 1:
            self.verified_pages += n - len(bad)
            del self._open[req.id]

    def _same(self, got: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.equal(got, want) if self.exact else bool(self._close(got, want).all())

    def _close(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        return got == want if self.exact else torch.isclose(got, want, rtol=1e-6, atol=1e-7)

    def _mismatch(self, req: Request, page: int, layer: int, origin: list[str], diff: float) -> None:
        self.mismatches += 1
        if self.first_mismatch is None:
            tier = origin[page] if page < len(origin) else "cache"
            self.first_mismatch = (f"{self.coords.label()}: KV mismatch in request {req.id}, page {page}, "
                                   f"layer {self.layout.first_layer + layer}, served from {tier} "
                                   f"(max abs diff {diff:.3g})")

    def report(self) -> dict:
        return {"kv_verified_pages": self.verified_pages, "kv_mismatches": self.mismatches,
                "kv_first_mismatch": self.first_mismatch}
