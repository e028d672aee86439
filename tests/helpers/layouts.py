"""KV layouts shared by tests: one small layout for bookkeeping, and the slice of a model each
rank holds (8 layers and 4 kv heads in all) for tests across topologies."""
from hicache_async.layout import KVLayout
from hicache_async.topology import RankCoords, kv_head_range, split_range

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=4, page_size=4)   # 512-byte pages: cheap to fill

TOTAL_LAYERS, TOTAL_HEADS = 8, 4


def rank_layout(coords: RankCoords, attention: str = "mha", head_dim: int = 4, page_size: int = 4) -> KVLayout:
    """The layout a rank holds: its PP stage's layers and (MHA) its TP share of the kv heads,
    or the one head it replicates when TP exceeds them."""
    layers = split_range(TOTAL_LAYERS, coords.pp_size, coords.pp_rank)
    heads = kv_head_range(TOTAL_HEADS, coords.tp_size, coords.tp_rank) if attention == "mha" else range(1)
    return KVLayout(num_layers=len(layers), kv_heads=len(heads), head_dim=head_dim, page_size=page_size,
                    attention=attention, first_layer=layers.start, first_head=heads.start,
                    total_layers=TOTAL_LAYERS, total_kv_heads=TOTAL_HEADS if attention == "mha" else 1)


def grid(tp: int, pp: int, cp: int) -> list[RankCoords]:
    """Every rank of a tp x pp x cp world."""
    return [RankCoords.of(r, tp, pp, cp) for r in range(tp * pp * cp)]
