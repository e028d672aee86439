"""The tiny reference engine's model: a decoder-only transformer over a paged KV pool.

It exists to prove the cache: greedy tokens from a run that reuses cached KV must equal a
cache-less run's. Math is float64 so batch shape never flips an argmax; KV is stored as
float32 (the pool's logical dtype), K after rotary. TP splits heads (above the number of kv
heads it replicates each kv head, see `kv_head_range`), PP splits layers, CP splits the
batch's new tokens; every rank stores the full KV of its layers and kv heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...errors import UsageError
from ...layout import KVLayout
from ...parallel.dist_wait import recv, wait_work
from ...topology import RankCoords, check_topology, kv_head_range, split_range
from .attention import attend, project, read_kv, write_kv
from .config import ModelConfig
from .weights import DTYPE, LayerWeights, embedding, layer_weights, lm_head

if TYPE_CHECKING:
    from ...parallel.groups import ParallelGroups

ACTIVATION_TAG = 7  # p2p tag for hidden states between stages; the cache's pp_sync uses another


@dataclass
class SeqChunk:
    tokens: list[int]  # the new tokens to run for this sequence
    start: int         # position of tokens[0] = tokens of this sequence already in KV
    pages: list[int]   # device page ids covering positions [0, start + len(tokens)), in order

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


class TinyModel:
    """One rank's share of the model: its stage's layers and its TP rank's heads."""

    def __init__(self, cfg: ModelConfig, coords: RankCoords | None = None,
                 groups: ParallelGroups | None = None, *, timeout_s: float = 60.0) -> None:
        self.cfg = cfg
        self.timeout_s = timeout_s  # bounds the waits on other stages
        self.coords = coords = coords or RankCoords()
        self.groups = groups
        check_topology(coords.tp_size, coords.pp_size, coords.cp_size, num_layers=cfg.layers,
                       kv_heads=cfg.kv_heads, attention=cfg.attention, q_heads=cfg.q_heads)
        self.layers = split_range(cfg.layers, coords.pp_size, coords.pp_rank)
        self.kv_heads = (kv_head_range(cfg.kv_heads, coords.tp_size, coords.tp_rank)
                         if cfg.attention == "mha" else range(1))
        q_heads = split_range(cfg.q_heads, coords.tp_size, coords.tp_rank)
        self.weights = [layer_weights(cfg, layer, q_heads, self.kv_heads) for layer in self.layers]
        self.first_stage = coords.pp_rank == 0
        self.last_stage = coords.pp_rank == coords.pp_size - 1
        self.embed = embedding(cfg) if self.first_stage else None
        self.head = lm_head(cfg) if self.last_stage else None

    def kv_layout(self, page_size: int) -> KVLayout:
        mla = self.cfg.attention == "mla"
        return KVLayout(
            num_layers=len(self.layers), kv_heads=len(self.kv_heads),
            head_dim=self.cfg.mla_latent + self.cfg.mla_rope_dim if mla else self.cfg.head_dim,
            page_size=page_size, dtype=torch.float32, attention=self.cfg.attention,
            first_layer=self.layers.start, first_head=self.kv_heads.start,
            total_layers=self.cfg.layers, total_kv_heads=1 if mla else self.cfg.kv_heads,
            model_id=self.cfg.model_id)

    async def forward(self, batch: list[SeqChunk], kv: torch.Tensor,
                      layer_ready: Callable[[int], Awaitable[None]] | None = None) -> list[int]:
        """Run the new tokens, store their KV, return each sequence's greedy next token.

        The result is identical on every rank: the last stage decides, then broadcasts.
        Waits on other stages are awaited; TP/CP collectives inside a layer block (briefly).
        """
        logits = await self.last_logits(batch, kv, layer_ready)
        tokens = torch.zeros(len(batch), dtype=torch.int64)
        if logits is not None:
            tokens = logits.argmax(dim=-1)
        world = self.groups.world if self.groups is not None else None
        if _size(world) > 1:
            work = dist.broadcast(tokens, src=self.groups.last_stage_root, group=world,
                                  async_op=True)
            await wait_work(work, what="next-token broadcast", coords=self.coords,
                            timeout_s=self.timeout_s)
        return tokens.tolist()

    async def last_logits(self, batch: list[SeqChunk], kv: torch.Tensor,
                          layer_ready: Callable[[int], Awaitable[None]] | None = None
                          ) -> torch.Tensor | None:
        """Logits [len(batch), vocab] of each sequence's last new token; None off the last stage."""
        self._check(batch, kv)
        positions = torch.cat([torch.arange(s.start, s.end) for s in batch])
        total = len(positions)
        ends = torch.tensor([len(s.tokens) for s in batch]).cumsum(0).tolist()
        spans = [(torch.tensor(s.pages), range(end - len(s.tokens), end))
                 for s, end in zip(batch, ends)]
        rows = split_range(total, self._cp_size, self._cp_index)
        if self.first_stage:
            hidden = self.embed[torch.tensor([t for s in batch for t in s.tokens])]
        else:
            hidden = torch.empty(total, self.cfg.hidden, dtype=DTYPE)
            await recv(hidden, src=self.groups.prev_stage, tag=ACTIVATION_TAG,
                       what="activations from the previous stage", coords=self.coords,
                       timeout_s=self.timeout_s)
        h = hidden[rows.start:rows.stop]
        for i, w in enumerate(self.weights):
            if layer_ready is not None:
                await layer_ready(i)
            h = h + self._attention(kv[i], w, _rms_norm(h), spans, positions, rows)
            x = _rms_norm(h)
            h = h + (F.silu(x @ w.w_gate) * (x @ w.w_up)) @ w.w_down
        hidden = self._cp_gather(h, total)
        if not self.last_stage:
            work = dist.isend(hidden, dst=self.groups.next_stage, tag=ACTIVATION_TAG)
            await wait_work(work, what="activations to the next stage", coords=self.coords,
                            timeout_s=self.timeout_s, spin_s=0.0)
            return None
        return _rms_norm(hidden[[end - 1 for end in ends]]) @ self.head

    def _attention(self, kv_layer: torch.Tensor, w: LayerWeights, x: torch.Tensor,
                   spans: list[tuple[torch.Tensor, range]], positions: torch.Tensor,
                   rows: range) -> torch.Tensor:
        """Attention output of this rank's rows, after the row-parallel projection and TP sum.

        `spans` gives each sequence's page ids and its rows in the batch; every new row's KV
        is stored (gathered over CP) before any is read.
        """
        q, new_kv = project(self.cfg, w, x, positions[rows.start:rows.stop])
        new_kv = self._cp_gather(new_kv.to(kv_layer.dtype), len(positions))
        for pages, span in spans:
            write_kv(kv_layer, pages, positions[span.start:span.stop], new_kv[span.start:span.stop])
        out = torch.zeros(len(rows), q.shape[1] * self.cfg.head_dim, dtype=DTYPE)
        for pages, span in spans:
            lo, hi = max(span.start, rows.start), min(span.stop, rows.stop)
            if lo < hi:
                q_pos = positions[lo:hi]
                cache = read_kv(kv_layer, pages, int(q_pos[-1]) + 1)
                local = slice(lo - rows.start, hi - rows.start)
                out[local] = attend(self.cfg, w, q[local], q_pos, cache)
        out = out @ w.wo
        tp = self.groups.tp if self.groups is not None else None
        if _size(tp) > 1 and len(rows):  # TP peers share a CP rank, so they skip together
            dist.all_reduce(out, group=tp)
        return out

    @property
    def _cp_size(self) -> int:
        return _size(self.groups.cp if self.groups is not None else None)

    @property
    def _cp_index(self) -> int:
        return dist.get_rank(self.groups.cp) if self._cp_size > 1 else 0

    def _cp_gather(self, part: torch.Tensor, total: int) -> torch.Tensor:
        """All rows [total, ...] from every CP rank's contiguous share (shares may be empty)."""
        size = self._cp_size
        if size == 1:
            return part
        shares = [split_range(total, size, r) for r in range(size)]
        padded = part.new_zeros(len(shares[0]), *part.shape[1:])
        padded[:len(part)] = part
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=self.groups.cp)
        return torch.cat([g[:len(s)] for g, s in zip(gathered, shares)])

    def _check(self, batch: list[SeqChunk], kv: torch.Tensor) -> None:
        if not batch:
            raise UsageError("forward needs at least one sequence, got an empty batch")
        page_size = kv.shape[3]
        expected = tuple(self.kv_layout(page_size).layer_page_shape)
        if kv.shape[0] != len(self.layers) or tuple(kv.shape[2:]) != expected:
            raise UsageError(f"kv pool shape {tuple(kv.shape)} does not match this rank's "
                             f"{len(self.layers)} layers x pages x {expected}")
        for seq in batch:
            if not seq.tokens or seq.start < 0:
                raise UsageError(f"sequence chunk needs tokens and start >= 0, got "
                                 f"{len(seq.tokens)} tokens at start {seq.start}")
            if len(seq.pages) * page_size < seq.end:
                raise UsageError(f"{len(seq.pages)} pages of {page_size} cannot hold "
                                 f"{seq.end} tokens")
            bad = [t for t in seq.tokens if not 0 <= t < self.cfg.vocab]
            if bad:
                raise UsageError(f"token id {bad[0]} outside the vocabulary of {self.cfg.vocab}")
