"""Tenants: requests with different `cache_salt`s never share a page in L1, L2 or L3, within a
run or across runs over one store, and one salt shares as before. The replay's KV is a
function of the salt, so a hit across tenants would be a KV mismatch (exit 1)."""
import json
import os
import subprocess
import sys

import anyio
import pytest

from hicache_async.app.cli import main
from hicache_async.config import CacheConfig
from hicache_async.engine.replay.trace import read_trace
from hicache_async.events import HostEvent
from hicache_async.hicache.cache import TieredCache
from hicache_async.hicache.ops import CacheOp
from hicache_async.hicache.radix import RadixTree
from hicache_async.hicache.storage_tier import StorageTier
from hicache_async.keys import make_key_scheme, page_hashes, tenant_digest
from hicache_async.kinds import TransferKind
from hicache_async.pools import DevicePool, HostPool
from hicache_async.sim.jobs.oracle import unbounded_oracle
from hicache_async.storage.memory import MemoryStorage
from hicache_async.transfer.page_store import PageStore
from tests.helpers.layouts import LAYOUT

PROMPT = 1024            # two 512-token blocks: 16 pages of 64, 15 of them reusable (the last token is computed)
REUSABLE = 15 * 64


def test_the_salt_enters_the_first_page_and_every_later_page_chains_from_it():
    tokens = list(range(12))
    plain, a, b = page_hashes(tokens, 4), page_hashes(tokens, 4, salt="a"), page_hashes(tokens, 4, salt="b")
    assert len({*plain, *a, *b}) == 9                                  # no page shared across salts
    assert a == page_hashes(tokens, 4, salt="a")                       # one salt: the same keys
    assert page_hashes(tokens[4:], 4, prior=a[0]) == a[1:]             # later pages only chain
    assert page_hashes(tokens, 4, salt=None) == plain
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt"):
            page_hashes(tokens, 4, salt=bad)
    with pytest.raises(ValueError, match="not both"):
        page_hashes(tokens, 4, prior=plain[0], salt="a")


def test_a_tenant_digest_is_eight_bytes_zero_for_no_salt():
    assert tenant_digest(None) == bytes(8)
    assert len(tenant_digest("a")) == 8 and tenant_digest("a") == tenant_digest("a")
    assert len({tenant_digest(s) for s in ("a", "b", "tenant-0", None)}) == 4


def test_each_salt_has_its_own_tree():
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4], [0, 1], ["a0", "a1"], salt="a")
    assert tree.match_prefix([1, 2, 3, 4], salt="b").device_tokens == 0
    assert tree.match_prefix([1, 2, 3, 4]).device_tokens == 0          # no salt is a tenant too
    assert tree.match_prefix([1, 2, 3, 4], salt="a").device_pages == [0, 1]
    assert tree.insert([1, 2, 3, 4], [5, 6], ["b0", "b1"], salt="b").duplicate_pages == []
    assert tree.graft_host([1, 2, 3, 4, 5, 6], 2, ["b0", "b1", "b2"], [9], salt="b") == []
    match = tree.match_prefix([1, 2, 3, 4, 5, 6], salt="b")
    assert match.device_pages == [5, 6] and match.host_tokens == 2 and match.host_nodes[0].salt == "b"
    assert tree.match_prefix([1, 2, 3, 4, 5, 6], salt="a").host_tokens == 0
    tree.lock_device(match.device_nodes[-1])                           # paths stop at a tenant's root
    assert [n.hashes for n in tree.path_to(match.device_nodes[-1])] == [["b0", "b1"]]
    tree.lock_device(match.device_nodes[-1], -1)
    leaves = list(tree.lru_device_leaves())                            # roots are never candidates
    assert sorted(n.salt for n in leaves) == ["a", "b"] and all(n.num_pages for n in leaves)
    device, host = tree.remove(leaves[0])
    assert device and not any(n.salt == leaves[0].salt for n in tree.lru_device_leaves())


def _trace(tmp_path, rows: list[tuple], name: str = "trace.jsonl") -> str:
    """One line per (hash_ids, cache_salt or None), a second apart, PROMPT tokens, one output."""
    lines = []
    for i, (ids, salt) in enumerate(rows):
        line = {"timestamp": 1000 * i, "input_length": PROMPT, "output_length": 1, "hash_ids": ids}
        if salt is not None:
            line["cache_salt"] = salt
        lines.append(json.dumps(line))
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _replay(trace: str, tmp_path, *flags: str, fault: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "HICACHE_ASYNC_FAULT"}
    if fault:
        env["HICACHE_ASYNC_FAULT"] = fault
    out = tmp_path / "out.json"
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "hicache_async", "replay", trace, "--timeout", "30",
                           "--json", str(out), *flags], env=env, capture_output=True, text=True, timeout=150)
    return done, json.loads(out.read_text()) if out.exists() else {}


def _hits(out: dict) -> int:
    return out["tokens_from_l1"] + out["tokens_from_l2"] + out["tokens_from_l3"]


SAME_PROMPT = [([1, 2], "a"), ([1, 2], "b"), ([1, 2], "a"), ([1, 2], "b"), ([1, 2], None)]


@pytest.mark.parametrize("tier,flags", [
    ("l1", ["--storage", "none"]),
    ("l2", ["--storage", "none", "--device-pages", "16"]),      # room for one request: the rest is on the host
], ids=["l1", "l2"])
def test_the_same_prompt_under_two_salts_hits_only_its_own_tenant(tier, flags, tmp_path):
    trace = _trace(tmp_path, SAME_PROMPT)
    done, out = _replay(trace, tmp_path, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    # Lines 3 and 4 hit what lines 1 and 2 of their own tenant left; 2 and 5 hit nothing.
    assert out[f"tokens_from_{tier}"] == _hits(out) == 2 * REUSABLE == out["oracle_tokens"], out
    assert out["kv_verified_pages"] == 2 * 15 and out["kv_mismatches"] == 0
    blind = unbounded_oracle([r.__class__(**{**r.__dict__, "cache_salt": None})
                              for r in read_trace(trace, 64)], 64)
    assert blind.tokens == 4 * REUSABLE                                # what a salt-blind cache would serve


def test_tenants_miss_each_other_in_l3_within_a_run(tmp_path):
    """Four tenants in turn: the host holds two requests, so the second round comes from L3."""
    trace = _trace(tmp_path, [([1, 2], s) for s in "abcdabcd"])
    done, out = _replay(trace, tmp_path, "--storage", "memory", "--device-pages", "16", "--host-pages", "32",
                        "--prefetch-threshold", "64")
    assert done.returncode == 0, done.stdout + done.stderr
    assert out["tokens_from_l3"] > 0 and out["kv_mismatches"] == 0, out
    assert _hits(out) <= out["oracle_tokens"] == 4 * REUSABLE


def test_tenants_miss_each_other_across_runs_over_one_store(tmp_path):
    store = ["--storage", "file", "--storage-path", str(tmp_path / "l3"), "--prefetch-threshold", "64"]
    done, first = _replay(_trace(tmp_path, [([1, 2], "a")], "first.jsonl"), tmp_path, *store)
    assert done.returncode == 0 and first["l3_bytes_written"] > 0, done.stderr
    done, second = _replay(_trace(tmp_path, [([1, 2], "b"), ([1, 2], "a")], "second.jsonl"), tmp_path, *store)
    assert done.returncode == 0, done.stdout + done.stderr
    # b finds nothing of a's in the store; a finds its 15 pages there, not in b's L1 tree.
    assert second["tokens_from_l3"] == REUSABLE and second["tokens_from_l1"] == second["tokens_from_l2"] == 0
    assert second["kv_verified_pages"] == 15 and second["kv_mismatches"] == 0


def test_a_broken_page_hash_fails_the_replay(tmp_path):
    """Unchained page hashes name block 5's pages alike after block 1 and after block 2, so the
    second run reads the wrong ones from L3. The replay's KV is named by the trace, not by those
    hashes, so it sees it; the sound hash gives block 2's pages from L3 and no more."""
    first = _trace(tmp_path, [([1, 5], None), ([2, 6], None)], "first.jsonl")
    second = _trace(tmp_path, [([2, 5], None)], "second.jsonl")

    def twice(fault: str | None) -> tuple[subprocess.CompletedProcess, dict]:
        store = ["--storage", "file", "--storage-path", str(tmp_path / str(fault)), "--prefetch-threshold", "64"]
        done, _ = _replay(first, tmp_path, *store, fault=fault)
        assert done.returncode == 0, done.stderr
        return _replay(second, tmp_path, *store, fault=fault)

    done, out = twice(None)
    assert done.returncode == 0 and out["tokens_from_l3"] == 8 * 64 and out["kv_mismatches"] == 0, out
    done, out = twice("unchained-hash")
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert "KV mismatch in request 1, page 8" in error and "served from l3" in error, error


def test_interleaved_tenants_keep_the_per_tenant_oracle(tmp_path):
    """Four tenants' conversations, round robin: each shares a system block with the others
    (which a salt-blind cache would reuse) and grows its own history."""
    lines = []
    for turn in range(5):
        for tenant in range(4):
            ids = [100] + [1000 * tenant + k for k in range(turn + 1)]
            lines.append(json.dumps({"timestamp": 500 * len(lines), "input_length": 512 * len(ids) - 100,
                                     "output_length": 4, "hash_ids": ids, "cache_salt": f"tenant-{tenant}"}))
    path = tmp_path / "tenants.jsonl"
    path.write_text("\n".join(lines) + "\n")
    done, out = _replay(str(path), tmp_path, "--storage", "memory")
    assert done.returncode == 0, done.stdout + done.stderr
    assert out["kv_mismatches"] == 0 and out["kv_verified_pages"] > 0
    assert 0.95 * out["oracle_tokens"] <= _hits(out) <= out["oracle_tokens"], out
    trace = read_trace(str(path), 64)
    blind = unbounded_oracle([r.__class__(**{**r.__dict__, "cache_salt": None}) for r in trace], 64)
    assert out["oracle_tokens"] < blind.tokens


@pytest.mark.parametrize("salt", ['7', '""', '["a"]'])
def test_a_bad_cache_salt_is_one_line_naming_file_and_line(salt, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}\n'
                    f'{{"timestamp": 1, "input_length": 600, "output_length": 2, "hash_ids": [1, 2], '
                    f'"cache_salt": {salt}}}\n')
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}:2: cache_salt must be a non-empty string" in err, err


def test_simulate_spreads_conversations_over_tenants(tmp_path):
    """Ample pools and no L3, so every hit is an L1 hit that does not depend on timing."""
    runs = {}
    for tenants in (1, 2, 3):
        out = tmp_path / f"t{tenants}.json"
        done = subprocess.run([sys.executable, "-m", "hicache_async", "simulate", "--storage", "none",
                               "--device-pages", "400", "--host-pages", "800", "--tenants", str(tenants),
                               "--json", str(out)], capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stdout + done.stderr
        runs[tenants] = json.loads(out.read_text())
    for tenants, run in runs.items():
        assert run["tenants"] == tenants and run["outputs_match_reference"] and run["kv_mismatches"] == 0
    # Conversation c has system prompt c % 3 and tenant c % tenants: two tenants split the
    # conversations that share a system prompt, so more is computed; three tenants split
    # none of them, so the reuse is what one tenant gets.
    assert runs[2]["tokens_computed"] > runs[1]["tokens_computed"]
    assert runs[3]["tokens_computed"] == runs[1]["tokens_computed"]


def test_simulate_tenants_must_be_positive(capsys):
    assert main(["simulate", "--tenants", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tenants" in err and "0" in err, err


async def test_the_storage_tier_names_the_tenant_in_what_it_stores_and_asks_for():
    """A backup of a tenant's node is stored as that tenant's, and a prefetch asks for its
    request's tenant: the same page under another tenant's name is a counted miss."""
    cfg = CacheConfig(device_pages=8, host_pages=8, page_size=4)
    cache = TieredCache(cfg, DevicePool(LAYOUT, 8), HostPool(LAYOUT, 8))
    store = PageStore(MemoryStorage(), LAYOUT, make_key_scheme("rank-suffix", LAYOUT))
    tokens = list(range(8))
    hashes = page_hashes(tokens, 4, salt="acme")
    node = cache.tree.insert(tokens, cache.alloc_device(2), hashes, "acme").last
    write = CacheOp(TransferKind.WRITE, node, [HostEvent()], 2, 0, hashes=hashes, host_pages=cache.alloc_host(2))
    async with anyio.create_task_group() as tasks:
        tier = StorageTier(cache, store, cfg, tasks)
        tier.back_up([write])
        backup = cache.ledger.queues[TransferKind.BACKUP].head()
        await backup.done.wait(30, "backup")
        assert backup.result.ok == [True, True]
        mine = tier.prefetch(1, None, tokens, 0, hashes, salt="acme")
        theirs = tier.prefetch(2, None, tokens, 0, hashes, salt="other")
        for op in (mine, theirs):
            await op.done.wait(30, "prefetch")
    assert (mine.result.pages, theirs.result.pages, theirs.result.corrupt) == (2, 0, 1)
    cache.close()
