import hashlib
import re
import struct
import subprocess
import sys

import pytest

from hicache_async.errors import UsageError
from hicache_async.keys import RankSuffixKeys, UnifiedKeys, make_key_scheme, page_hashes
from hicache_async.topology import RankCoords
from tests.helpers.layouts import LAYOUT, grid, rank_layout


def test_page_hash_is_chained_sha256_of_le_u32_tokens():
    tokens = [1, 2, 3, 2**32 - 1, 5, 6, 7, 8]
    first = hashlib.sha256(struct.pack("<4I", 1, 2, 3, 2**32 - 1)).digest()
    second = hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert page_hashes(tokens, 4) == [first.hex(), second.hex()]


def test_page_hash_depends_on_the_whole_prefix():
    a, b = page_hashes([1, 2, 3, 4, 5, 6], 3), page_hashes([9, 2, 3, 4, 5, 6], 3)
    assert a[0] != b[0] and a[1] != b[1]


def test_prior_continues_the_chain_and_partial_page_gets_no_key():
    tokens = list(range(100, 111))
    full = page_hashes(tokens, 4)
    assert len(full) == 2
    assert page_hashes(tokens[4:], 4, prior=full[0]) == full[1:]
    assert page_hashes(tokens[:3], 4) == []


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="4294967296"):
        page_hashes([2**32, 0], 2)
    with pytest.raises(ValueError, match="zz"):
        page_hashes([1, 2], 2, prior="zz")
    with pytest.raises(ValueError, match="page_size"):
        page_hashes([1], 0)


def test_page_hashes_agree_across_processes():
    code = "from hicache_async.keys import page_hashes; print(','.join(page_hashes(range(50), 8)))"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={"PYTHONHASHSEED": seed}, check=True).stdout.strip() for seed in ("1", "2")}
    assert outs == {",".join(page_hashes(range(50), 8))}


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_rank_suffix_never_names_different_content_alike(attention):
    """One key, one content: within a topology and across every topology sharing a storage."""
    h = page_hashes(range(4), 4)[0]
    content_of = {}
    for tp in (1, 2, 4, 8):     # tp 8 replicates each of the 4 kv heads on 2 ranks
        for pp in (1, 2, 4):
            for cp in (1, 2):
                for c in grid(tp, pp, cp):
                    keys = RankSuffixKeys(rank_layout(c, attention), c)
                    for spec in keys.objects(h):
                        content = (spec.layers, spec.heads)
                        assert content_of.setdefault(spec.key, content) == content, (tp, pp, cp, c)


def test_rank_suffix_suffixes():
    h = "ab" * 32
    c = RankCoords(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, cp_rank=1, cp_size=2)
    ns = rank_layout(c).namespace()
    assert RankSuffixKeys(rank_layout(c), c).objects(h)[0].key == f"{h}_{ns}_tp1of2_pp1of2_cp1of2"
    mla = RankSuffixKeys(rank_layout(c, "mla"), c)
    assert mla.objects(h)[0].key == f"{h}_{rank_layout(c, 'mla').namespace()}_pp1of2"
    assert not mla.writes and mla.cp_shared


def test_rank_suffix_mla_keys_identical_across_tp_ranks_and_only_tp0_writes():
    h = "cd" * 32
    ranks = [RankCoords(tp_rank=r, tp_size=4) for r in range(4)]
    schemes = [RankSuffixKeys(rank_layout(c, "mla"), c) for c in ranks]
    assert len({s.objects(h)[0].key for s in schemes}) == 1
    assert [s.writes for s in schemes] == [True, False, False, False]


def test_default_coords_give_valid_suffixes():
    layout = LAYOUT
    spec = make_key_scheme("rank-suffix", layout, RankCoords()).objects("00" * 32)[0]
    assert spec.key == f"{'00' * 32}_{layout.namespace()}_tp0of1"
    assert RankSuffixKeys(layout).objects("00" * 32)[0] == spec
    assert spec.layers == range(2) and spec.heads == range(2)


def test_unified_key_names_what_it_holds():
    c = RankCoords(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    specs = UnifiedKeys(rank_layout(c), c, head_group=2).objects("ef" * 32)
    assert [(s.layers, s.heads) for s in specs] == [(range(l, l + 1), range(2, 4)) for l in range(4, 8)]
    assert all(re.fullmatch(r"(ef){32}_[0-9a-f]{16}_L(\d)-\2_H1", s.key) for s in specs)
    mla = UnifiedKeys(rank_layout(c, "mla"), c).objects("ef" * 32)
    assert all(re.fullmatch(r"(ef){32}_[0-9a-f]{16}_L(\d)-\2", s.key) for s in mla)


def _unified_keys(tp: int, pp: int, head_group: int = 1) -> set[str]:
    return {s.key for c in grid(tp, pp, 1)
            for s in UnifiedKeys(rank_layout(c), c, head_group).objects("12" * 32)}


def test_unified_objects_are_the_same_whatever_the_topology():
    assert _unified_keys(2, 1) == _unified_keys(4, 1) == _unified_keys(1, 1)
    assert _unified_keys(1, 2) == _unified_keys(1, 1) == _unified_keys(2, 4)
    assert _unified_keys(2, 1, head_group=2) == _unified_keys(1, 2, head_group=2)


def test_unified_namespace_includes_head_group_and_rejects_misaligned_groups():
    assert _unified_keys(1, 1, 1).isdisjoint(_unified_keys(1, 1, 2))
    c = RankCoords(tp_rank=0, tp_size=4)
    with pytest.raises(UsageError, match="head_group 2"):
        UnifiedKeys(rank_layout(c), c, head_group=2)


def test_unknown_scheme_is_named():
    with pytest.raises(UsageError, match="'rank'"):
        make_key_scheme("rank", rank_layout(RankCoords()), RankCoords())
