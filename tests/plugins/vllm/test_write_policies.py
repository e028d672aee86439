"""What each write policy puts into L3, in real vLLM with a 16-page host tier, read back by a
new process; and a corrupt object that heals after one recompute. Every output read back
equals the same request's cache-less run."""
from __future__ import annotations

import pytest

from .conftest import BLOCK, page_files
from .engines import RESET, gen, run_engine, same_output, tiers

HIT = 288


def _store(tmp_path, policy: str) -> dict:
    return {"storage": "file", "storage_path": str(tmp_path / "store"), "host_pages": 16, "write_policy": policy}


def _read_back(llama, prompts, extra) -> list[dict]:
    """P and R in a new process over the same store."""
    return run_engine(llama, [gen(prompts["p"]), RESET, gen(prompts["r"])], extra)


def test_write_through_stores_every_saved_page(llama, prompts, cold, tmp_path):
    extra = _store(tmp_path, "write_through")
    run_engine(llama, [gen(prompts["p"]), gen(prompts["r"])], extra)
    p, r = _read_back(llama, prompts, extra)
    assert tiers(p)[1] == HIT and same_output(p, cold["p"])
    assert tiers(r)[1] == HIT and same_output(r, cold["r"])


def test_write_through_selective_stores_a_page_on_its_second_use(llama, prompts, cold, tmp_path):
    """P computed, then served from vLLM's own cache, then from the host tier; R once."""
    extra = _store(tmp_path, "write_through_selective")
    run_engine(llama, [gen(prompts["p"]), gen(prompts["p"]), RESET, gen(prompts["p"]), gen(prompts["r"])], extra)
    assert all(page_files(tmp_path / "store", prompts["p"])[:9])
    assert not any(page_files(tmp_path / "store", prompts["r"]))
    p, r = _read_back(llama, prompts, extra)
    assert tiers(p)[1] == HIT and same_output(p, cold["p"])
    assert tiers(r)[1] == 0 and same_output(r, cold["r"])


def test_write_back_stores_what_leaves_the_host_tier_and_the_rest_at_shutdown(llama, prompts, cold, tmp_path):
    """P and R are 18 pages in a 16-page tier: to save R, P's two oldest pages leave it through
    L3 (R's last two pages may skip the tier, if their slots are still leaving: a save never
    waits); what the host tier holds at the end is written by the worker's close on the
    engine's way out."""
    extra = _store(tmp_path, "write_back")
    run_engine(llama, [gen(prompts["p"]), gen(prompts["r"])], extra)
    assert all(page_files(tmp_path / "store", prompts["p"]))
    assert all(page_files(tmp_path / "store", prompts["r"])[:7])
    p, r = _read_back(llama, prompts, extra)
    assert tiers(p)[1] == HIT and same_output(p, cold["p"])
    assert tiers(r)[1] >= 7 * BLOCK and same_output(r, cold["r"])


@pytest.mark.parametrize("page", [0, 4])
def test_a_corrupt_object_heals_after_one_recompute(llama, prompts, cold, tmp_path, page):
    extra = {"storage": "file", "storage_path": str(tmp_path / "store")}
    run_engine(llama, [gen(prompts["p"])], extra)
    (obj,) = page_files(tmp_path / "store", prompts["p"])[page]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x40
    obj.write_bytes(bytes(data))
    (short,) = run_engine(llama, [gen(prompts["p"])], extra)
    assert short["cached"] == page * BLOCK and same_output(short, cold["p"])
    (healed,) = run_engine(llama, [gen(prompts["p"])], extra)
    assert tiers(healed)[1] == HIT and same_output(healed, cold["p"])
