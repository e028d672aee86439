"""Nothing wrong ever becomes KV in real vLLM: a corrupt, truncated, foreign, sealed-by-another
or other-dtype object, junk under the store, or a dead Mooncake master is a miss (or a shorter
hit), and every output stays exactly the cache-less run's. Objects are written by the session's
writer (`SharedL3`) under a salt of the test's own, and damaged before another process reads."""
from __future__ import annotations

import os
import shutil

import pytest

from .conftest import BLOCK, flip_byte, page_files
from .engines import RESET, gen, run_engine, same_output


@pytest.mark.parametrize("page", [0, 4])
def test_a_flipped_byte_ends_the_hit_at_its_page(prompts, cold, l3, salt, page):
    l3.write([gen(prompts["p"], salt)])
    (obj,) = page_files(l3.path, prompts["p"], salt)[page]
    flip_byte(obj)
    (out,) = l3.read([gen(prompts["p"], salt)])
    assert out["cached"] == page * BLOCK and same_output(out, cold["p"])


def test_a_truncated_object_and_junk_files_are_misses_not_crashes(llama, prompts, cold, l3, salt, tmp_path):
    """A store of P's objects alone, with the junk in it before the reading process opens it."""
    l3.write([gen(prompts["p"], salt)])
    store = tmp_path / "store"
    for obj in (f for page in page_files(l3.path, prompts["p"], salt) for f in page):
        (store / obj.relative_to(l3.path)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(obj, store / obj.relative_to(l3.path))
    (obj,) = page_files(store, prompts["p"], salt)[2]
    obj.write_bytes(obj.read_bytes()[:100])
    (store / "zz").mkdir()
    (store / "zz" / "not-an-object").write_bytes(os.urandom(777))
    (store / ".half-written.tmp").write_bytes(b"")
    (store / "index").write_text("{ not json")
    (out,) = run_engine(llama, [gen(prompts["p"], salt)], {"storage": "file", "storage_path": str(store)})
    assert out["cached"] == 2 * BLOCK and same_output(out, cold["p"])


def test_a_sealed_store_serves_its_own_secret_and_no_other(llama, prompts, cold, l3, salt, tmp_path):
    """Sealed objects under the shared L3: a new process with the secret is served them; one
    with another secret, or none (the session's reader), is not."""
    def sealed(name: str) -> dict:
        secret = tmp_path / name
        if not secret.exists():
            secret.write_bytes(os.urandom(32))
            secret.chmod(0o600)
        return {**l3.extra, "storage_secret_file": str(secret)}

    p = gen(prompts["p"], salt)
    run_engine(llama, [p], sealed("secret"))
    (right,) = run_engine(llama, [p], sealed("secret"))
    assert right["cached"] == 288 and same_output(right, cold["p_prefix_cache"])
    (wrong,) = run_engine(llama, [p], sealed("other-secret"))
    assert wrong["cached"] == 0 and same_output(wrong, cold["p"])
    (unsealed,) = l3.read([p])
    assert unsealed["cached"] == 0 and same_output(unsealed, cold["p"])


def test_a_bfloat16_store_is_a_miss_for_a_float16_engine(llama, prompts, l3, salt):
    p = gen(prompts["p"], salt)
    l3.write([p])
    first, again = run_engine(llama, [p, RESET, p], l3.extra, dtype="float16")
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
