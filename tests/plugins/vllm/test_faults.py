"""Nothing wrong ever becomes KV in real vLLM: a corrupt, truncated, foreign, sealed-by-another
or other-dtype object, junk under the store, or a dead Mooncake master is a miss (or a shorter
hit), and every output stays exactly the cache-less run's."""
from __future__ import annotations

import os
import shutil

import pytest

from .conftest import BLOCK, page_files
from .engines import RESET, gen, run_engine, same_output


@pytest.fixture(scope="module")
def written(llama, prompts, tmp_path_factory) -> dict:
    """File stores an engine filled with P (plain, and sealed with one secret)."""
    root = tmp_path_factory.mktemp("written")
    secret = root / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    run_engine(llama, [gen(prompts["p"])], {"storage": "file", "storage_path": str(root / "plain")})
    run_engine(llama, [gen(prompts["p"])], {"storage": "file", "storage_path": str(root / "sealed"),
                                            "storage_secret_file": str(secret)})
    return {"plain": root / "plain", "sealed": root / "sealed", "secret": secret}


def _copy(store, tmp_path):
    return shutil.copytree(store, tmp_path / "store")


def _read(llama, prompts, store, **extra):
    return run_engine(llama, [gen(prompts["p"])], {"storage": "file", "storage_path": str(store), **extra})[0]


@pytest.mark.parametrize("page", [0, 4])
def test_a_flipped_byte_ends_the_hit_at_its_page(llama, prompts, cold, written, tmp_path, page):
    store = _copy(written["plain"], tmp_path)
    (obj,) = page_files(store, prompts["p"])[page]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x40
    obj.write_bytes(bytes(data))
    out = _read(llama, prompts, store)
    assert out["cached"] == page * BLOCK and same_output(out, cold["p"])


def test_a_truncated_object_and_junk_files_are_misses_not_crashes(llama, prompts, cold, written, tmp_path):
    store = _copy(written["plain"], tmp_path)
    (obj,) = page_files(store, prompts["p"])[2]
    obj.write_bytes(obj.read_bytes()[:100])
    (store / "zz").mkdir()
    (store / "zz" / "not-an-object").write_bytes(os.urandom(777))
    (store / ".half-written.tmp").write_bytes(b"")
    (store / "index").write_text("{ not json")
    out = _read(llama, prompts, store)
    assert out["cached"] == 2 * BLOCK and same_output(out, cold["p"])


def test_a_sealed_store_serves_its_own_secret_and_no_other(llama, prompts, cold, written, tmp_path):
    right = _read(llama, prompts, written["sealed"], storage_secret_file=str(written["secret"]))
    assert right["cached"] == 288 and same_output(right, cold["p_prefix_cache"])
    other = tmp_path / "other-secret"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    wrong = _read(llama, prompts, written["sealed"], storage_secret_file=str(other))
    assert wrong["cached"] == 0 and same_output(wrong, cold["p"])
    unsealed = _read(llama, prompts, written["sealed"])
    assert unsealed["cached"] == 0 and same_output(unsealed, cold["p"])


def test_a_bfloat16_store_is_a_miss_for_a_float16_engine(llama, prompts, written):
    extra = {"storage": "file", "storage_path": str(written["plain"])}
    first, again = run_engine(llama, [gen(prompts["p"]), RESET, gen(prompts["p"])], extra, dtype="float16")
    assert first["cached"] == 0
    assert again["params"]["hicache"]["host_tokens"] == 288      # its own float16 pages, from the host tier
    assert same_output(first, again)


def test_a_dead_mooncake_master_costs_seconds_never_outputs(llama, prompts, cold):
    from hicache_mooncake.master import MooncakeMaster

    with MooncakeMaster() as master:
        extra = {"storage": "mooncake", "mooncake_master": master.address,
                 "mooncake_metadata": master.metadata_url, "storage_timeout": 1.0}
        run_engine(llama, [gen(prompts["p"]), gen(prompts["r"])], extra)
        hit, after = run_engine(llama, [gen(prompts["p"]), {"op": "kill", "pid": master.pid}, gen(prompts["r"])],
                                extra)
        assert hit["params"]["hicache"]["l3_tokens"] == 288 and same_output(hit, cold["p_prefix_cache"])
        assert after["cached"] == 0 and same_output(after, cold["r"])
        assert after["seconds"] < 30
    (late,) = run_engine(llama, [gen(prompts["p"])], extra)     # a master gone before start: host tier alone
    assert late["cached"] == 0 and same_output(late, cold["p"])
