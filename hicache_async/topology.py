"""Where a rank sits in the tp x pp x cp grid, and which layers and heads it owns."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one simulated rank. Global rank order is (pp, cp, tp), tp fastest."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def rank(self) -> int:
        return (self.pp_rank * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank

    @classmethod
    def of(cls, rank: int, tp: int, pp: int, cp: int) -> "RankCoords":
        tp_rank = rank % tp
        cp_rank = (rank // tp) % cp
        pp_rank = rank // (tp * cp)
        return cls(tp_rank, tp, pp_rank, pp, cp_rank, cp)

    def peer(self, *, tp_rank: int | None = None, pp_rank: int | None = None,
             cp_rank: int | None = None) -> int:
        """Global rank of the peer that differs from this one only in the given coordinates."""
        return RankCoords(
            self.tp_rank if tp_rank is None else tp_rank, self.tp_size,
            self.pp_rank if pp_rank is None else pp_rank, self.pp_size,
            self.cp_rank if cp_rank is None else cp_rank, self.cp_size,
        ).rank

    def label(self) -> str:
        return f"rank {self.rank} (tp{self.tp_rank} pp{self.pp_rank} cp{self.cp_rank})"

    def attributes(self) -> dict[str, int]:
        """Span and log attributes naming this rank."""
        return {
            "parallel.rank": self.rank,
            "parallel.tp_rank": self.tp_rank, "parallel.tp_size": self.tp_size,
            "parallel.pp_rank": self.pp_rank, "parallel.pp_size": self.pp_size,
            "parallel.cp_rank": self.cp_rank, "parallel.cp_size": self.cp_size,
        }


def split_range(total: int, parts: int, index: int) -> range:
    """Contiguous split of `total` items into `parts`; the remainder goes to the lowest indices."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def kv_head_range(kv_heads: int, tp: int, tp_rank: int) -> range:
    """The kv heads (MHA/GQA) a TP rank holds.

    TP up to the number of kv heads splits them; above it, as real engines run GQA models,
    each head is replicated over `tp // kv_heads` consecutive ranks, so a rank holds one head
    and its query heads are exactly those that attend to it.
    """
    if tp <= kv_heads:
        return split_range(kv_heads, tp, tp_rank)
    head = tp_rank // (tp // kv_heads)
    return range(head, head + 1)


def check_topology(tp: int, pp: int, cp: int, *, num_layers: int, kv_heads: int,
                   attention: str, q_heads: int | None = None) -> None:
    """One-line usage errors for a grid the model cannot be split over.

    `q_heads` is None for an engine without query heads (the replay engine).
    """
    for name, value in (("--tp", tp), ("--pp", pp), ("--cp", cp)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if pp > num_layers:
        raise UsageError(f"--pp {pp} exceeds the model's {num_layers} layers")
    if attention == "mha" and kv_heads % tp and tp % kv_heads:
        raise UsageError(f"--tp {tp} neither divides the model's {kv_heads} kv heads nor is a "
                         f"multiple of them (each head then replicated over tp/{kv_heads} ranks)")
    if q_heads is not None and q_heads % tp:
        raise UsageError(f"--tp {tp} does not divide the model's {q_heads} query heads")
