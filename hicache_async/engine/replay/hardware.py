"""The planner's hardware model: the served model and the machine's links, in modelled time.

A replay moves small stand-in KV through every tier, so its figures would depend on the
machine running it if copies and storage calls took their wall time. Instead every transfer
takes the time this model gives it: the served model fixes how many bytes a page holds (and
how many of them a rank holds), the machine how fast each link moves them. A `Preset` names a
model and what serving it costs (prefill per token, one decode step); `HardwareModel` is the
preset plus the machine, each field the planner flag of the same name, so a sweep can
`dataclasses.replace` one of them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ...errors import UsageError
from ...topology import RankCoords, kv_head_range, split_range
from .clock import CostModel

BF16 = 2   # bytes a KV element


@dataclass(frozen=True)
class Preset:
    """A served model: its KV shape (from its config.json) and its compute costs.

    Costs are estimates for the stated deployment: prefill at 80% of the GPUs' dense peak
    (2 x active parameters FLOPs a token), a decode step reading every weight at half the HBM
    bandwidth. The README shows the arithmetic.
    """

    name: str
    layers: int
    kv_heads: int              # MHA/GQA: KV heads; MLA: 1, the latent every head shares
    head_dim: int              # MHA/GQA: width of K and of V; MLA: latent + rope width
    mla: bool
    prefill_us_per_token: float
    decode_us_per_step: float
    serving: str               # the deployment the costs assume

    @property
    def kv_bytes_per_token(self) -> int:
        planes = 1 if self.mla else 2      # MLA caches one latent, not K and V
        return self.layers * planes * self.kv_heads * self.head_dim * BF16


PRESETS = {p.name: p for p in (
    Preset("llama-3.1-8b", 32, 8, 128, False, 20.0, 10_000.0, "1x H100, bf16"),
    Preset("llama-3.1-70b", 80, 8, 128, False, 45.0, 21_000.0, "4x H100 (TP4), bf16"),
    Preset("qwen3-30b-a3b", 48, 4, 128, False, 8.0, 36_000.0, "1x H100, bf16"),
    Preset("deepseek-v3", 61, 1, 576, True, 6.0, 35_000.0, "8x H200, fp8 weights"),
)}
DEFAULT_MODEL = "llama-3.1-8b"

# L3 calls per transfer: storage ops move this many pages a call (hicache.storage_tier.SLICE_PAGES).
PAGES_PER_CALL = 64
LINKS = {"write": "pcie_gbps", "load": "pcie_gbps", "backup": "l3_write_gbps", "prefetch": "l3_read_gbps"}


@dataclass(frozen=True)
class HardwareModel:
    """The served model (a preset, with optional overrides) and the machine: one H100 node's
    PCIe 5 x16 link per GPU between L1 and L2, and a datacenter NVMe drive as L3."""

    model: str = DEFAULT_MODEL
    kv_bytes_per_token: int | None = None        # None: the preset's
    prefill_us_per_token: float | None = None    # None: the preset's
    decode_us_per_step: float | None = None      # None: the preset's
    pcie_gbps: float = 50.0                      # L1 <-> L2, each way
    l3_read_gbps: float = 7.0
    l3_write_gbps: float = 4.5
    l3_latency_us: float = 100.0                 # each storage call

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise UsageError(f"unknown --model {self.model!r}: the presets are {', '.join(PRESETS)}")
        for name in ("kv_bytes_per_token", "pcie_gbps", "l3_read_gbps", "l3_write_gbps", "l3_latency_us"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
        self.costs   # noqa: B018 - validates the cost overrides

    @property
    def preset(self) -> Preset:
        return PRESETS[self.model]

    @property
    def token_bytes(self) -> int:
        """KV bytes a token of the served model, over all its layers and heads."""
        return self.kv_bytes_per_token or self.preset.kv_bytes_per_token

    @property
    def costs(self) -> CostModel:
        p = self.preset
        return CostModel(
            prefill_us_per_token=p.prefill_us_per_token if self.prefill_us_per_token is None
            else self.prefill_us_per_token,
            decode_us_per_step=p.decode_us_per_step if self.decode_us_per_step is None
            else self.decode_us_per_step)

    def resolved(self) -> dict:
        """Every figure as the run uses it (presets filled in), for reports."""
        costs = self.costs
        return {**asdict(self), "kv_bytes_per_token": self.token_bytes,
                "prefill_us_per_token": costs.prefill_us_per_token,
                "decode_us_per_step": costs.decode_us_per_step}

    # -- what one rank moves --------------------------------------------------------------------

    def rank_share(self, coords: RankCoords) -> float:
        """The share of a page's bytes one rank holds, as the served model splits its KV: TP
        splits the KV heads (above their number each head is replicated), PP the layers;
        MLA's latent is one for all heads, so TP never splits it."""
        p = self.preset
        heads = 1.0 if p.mla else len(kv_head_range(p.kv_heads, coords.tp_size, coords.tp_rank)) / p.kv_heads
        return heads * len(split_range(p.layers, coords.pp_size, coords.pp_rank)) / p.layers

    def rank_pages(self, kind: str, pages: int, coords: RankCoords) -> int:
        """Pages of a `pages`-page transfer this rank moves: CP ranks each hold a contiguous
        block of a sequence's pages; an MLA latent is stored once, by TP rank 0."""
        if kind == "backup" and self.preset.mla and coords.tp_rank != 0:
            return 0
        return len(split_range(pages, coords.cp_size, coords.cp_rank))

    def transfer_s(self, kind: str, pages: int, coords: RankCoords, page_size: int) -> tuple[float, float]:
        """(seconds the link is busy, seconds of call latency) for this rank's part of a
        transfer of `pages` pages; L3 transfers pay the latency once per call."""
        mine = self.rank_pages(kind, pages, coords)
        nbytes = mine * page_size * self.token_bytes * self.rank_share(coords)
        busy = nbytes / (getattr(self, LINKS[kind]) * 1e9)
        calls = math.ceil(mine / PAGES_PER_CALL) if kind in ("backup", "prefetch") else 0
        return busy, calls * self.l3_latency_us * 1e-6
