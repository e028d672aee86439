"""The replay engine's pure functions: trace tokens, page chains, KV bytes, outputs and the oracle."""
import numpy as np
import pytest
import torch

from hicache_async.engine.replay.kv import ReplayKV
from hicache_async.engine.replay.model import next_tokens
from hicache_async.engine.replay.trace import TraceRequest, prompt_page_ids, prompt_tokens
from hicache_async.engine.replay.workload import ReplaySeq
from hicache_async.keys import page_digests, page_hashes
from hicache_async.request import Request
from hicache_async.sim.jobs.oracle import unbounded_oracle


def _req(ids, n, line=1, ts=0.0, out=4, salt=None):
    return TraceRequest(line, ts, n, out, tuple(ids), salt)


def test_equal_block_ids_give_equal_tokens_and_shared_prefix_pages():
    a = prompt_tokens(_req([7, 8, 9], 1400))
    b = prompt_tokens(_req([7, 8, 11], 1100))
    assert len(a) == 1400 and len(b) == 1100 and a.dtype == np.uint32
    assert np.array_equal(a[:1024], b[:1024]) and not np.array_equal(a[1024:1100], b[1024:1100])
    assert np.array_equal(a, prompt_tokens(_req([7, 8, 9], 1400)))          # deterministic
    assert not np.array_equal(a, prompt_tokens(_req([7, 8, 9], 1400), seed=1))
    da, db = page_digests(a, 64), page_digests(b, 64)
    assert da[:16] == db[:16] and da[16] != db[16]
    na, nb = prompt_page_ids(_req([7, 8, 9], 1400), 64), prompt_page_ids(_req([7, 8, 11], 1100), 64)
    assert len(na) == 21 and len(nb) == 17 and np.array_equal(na[:16], nb[:16]) and na[16] != nb[16]


@pytest.mark.parametrize("page_size", [1, 16, 64, 512])
def test_replay_prompts_hash_like_the_token_lists_the_cache_sees(page_size):
    """The array fast path packs a prompt exactly as the list path packs `req.prompt`."""
    tokens = prompt_tokens(_req([3, 4], 1000))
    assert [d.hex() for d in page_digests(tokens, page_size)] == page_hashes(tokens.tolist(), page_size)


def test_page_names_come_from_the_trace_prefix_and_the_tenant():
    """Equal names exactly where the token prefixes are equal; a salt renames every page."""
    a, b = _req([1, 5], 1024), _req([2, 5], 1024)           # block 5 after different prefixes
    short, salted = _req([1, 5], 700), _req([1, 5], 1024, salt="tenant-1")
    na, nb, ns, nt = (prompt_page_ids(r, 64) for r in (a, b, short, salted))
    assert np.array_equal(prompt_tokens(a)[512:], prompt_tokens(b)[512:])   # equal tokens ...
    assert not set(na.tolist()) & set(nb.tolist())                         # ... other prefixes
    assert np.array_equal(ns, na[:10]) and len(set(na.tolist())) == 16
    assert not set(nt.tolist()) & set(na.tolist())
    assert np.array_equal(nt, prompt_page_ids(_req([1, 5], 1024, salt="tenant-1"), 64))
    assert not np.array_equal(na, prompt_page_ids(a, 64, seed=1))


def test_pages_holding_outputs_are_named_by_their_prompt_and_place():
    req = _req([5], 100)
    seq = ReplaySeq(req, prompt_tokens(req), 32)
    names = [seq.page_id(k) for k in range(6)]
    assert names[:3] == prompt_page_ids(req, 32).tolist() and len(set(names)) == 6
    again = ReplaySeq(req, prompt_tokens(req), 32)
    assert [again.page_id(k) for k in range(6)] == names              # a pure function
    longer = _req([5], 101)
    assert ReplaySeq(longer, prompt_tokens(longer), 32).page_id(3) != names[3]
    salted = _req([5], 100, salt="t")
    assert ReplaySeq(salted, prompt_tokens(salted), 32).page_id(3) != names[3]


def test_kv_is_a_pure_function_sliced_by_global_layer_and_head():
    full = ReplayKV(4, 2, 4, 16, range(0, 4), range(0, 2))
    names = prompt_page_ids(_req([3, 4], 320), 64)                     # five pages
    values = full.pages(names)                                        # [layers, pages, ...]
    assert values.shape == (4, 5, 2, 16, 2, 4) and values.dtype == torch.float16
    assert torch.isfinite(values).all() and values.abs().min() >= 0.5
    assert torch.equal(values, full.pages(names))
    assert not torch.equal(values[:, 0], values[:, 1])                # the name (prefix) matters
    part = ReplayKV(4, 2, 4, 16, range(2, 4), range(1, 2))            # pp stage 1, tp rank 1
    assert torch.equal(part.pages(names), values[2:4, :, :, :, 1:2, :])
    assert torch.equal(part.expected(names, 1), values[3, :, :, :, 1:2, :])


def test_outputs_are_a_pure_function_of_the_prompt_and_their_index():
    seq = ReplaySeq(_req([1, 2], 600), prompt_tokens(_req([1, 2], 600)), 64)
    a, b = Request(1, [], 4, tag=seq), Request(2, [], 4, output=[0], tag=seq)
    first = next_tokens([a, b])
    assert first == next_tokens([a, b]) and first[0] != first[1]


def test_oracle_counts_leading_full_pages_seen_before_never_the_last_token():
    trace = [_req([1, 2], 1024, line=1), _req([1, 2], 1024, line=2), _req([1, 3], 700, line=3),
             _req([9], 64, line=4), _req([9], 64, line=5)]
    oracle = unbounded_oracle(trace, 64)
    # line 2: 15 of its 16 pages (the last token is computed); line 3: block 1's 8 pages;
    # line 5: a one-page prompt has no full page before its last token.
    assert oracle.tokens == (15 + 8) * 64
    assert oracle.distinct_pages == 16 + 2 + 1


def test_oracle_reuses_only_within_a_tenant():
    trace = [_req([1, 2], 1024, line=1, salt="a"), _req([1, 2], 1024, line=2, salt="b"),
             _req([1, 2], 1024, line=3, salt="a"), _req([1, 2], 1024, line=4)]
    oracle = unbounded_oracle(trace, 64)
    assert oracle.tokens == 15 * 64                  # line 3 only: lines 2 and 4 are other tenants
    assert oracle.distinct_pages == 3 * 16
