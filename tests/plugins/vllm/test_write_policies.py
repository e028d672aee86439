"""What each write policy puts into L3, in real vLLM with a 16-page host tier, read back by a
new process; and a corrupt object that heals after one recompute. Every output read back
equals the same request's cache-less run. Each policy's writer runs with vLLM's scheduling as
on CPU and as on a GPU (async: a step ahead of the worker). Each writer of a policy is a fresh process (under
write_back its exit writes what the host tier holds); the readers, and the healing test's
writer, are the session's (`SharedL3`), each test under a salt of its own."""
from __future__ import annotations

import pytest

from .conftest import BLOCK, flip_byte, page_files
from .engines import RESET, SCHEDULINGS, gen, run_engine, same_output, tiers

HIT = 288


def _write(llama, l3, policy: str, steps: list[dict], scheduling: dict) -> None:
    """The steps in a fresh engine with a 16-page host tier under `policy`, over the shared L3."""
    run_engine(llama, steps, {**l3.extra, "host_pages": 16, "write_policy": policy}, **scheduling)


def _read_back(prompts, l3, salt) -> list[dict]:
    """P and R in a new process over the same store."""
    return l3.read([gen(prompts["p"], salt), RESET, gen(prompts["r"], salt)])


@SCHEDULINGS
def test_write_through_stores_every_saved_page(llama, prompts, cold, l3, salt, scheduling):
    _write(llama, l3, "write_through", [gen(prompts["p"], salt), gen(prompts["r"], salt)], scheduling)
    p, r = _read_back(prompts, l3, salt)
    assert tiers(p)[1] == HIT and same_output(p, cold["p"])
    assert tiers(r)[1] == HIT and same_output(r, cold["r"])


@SCHEDULINGS
def test_write_through_selective_stores_a_page_on_its_second_use(llama, prompts, cold, l3, salt, scheduling):
    """P computed, then served from vLLM's own cache, then from the host tier; R once."""
    p, r = (gen(prompts[name], salt) for name in "pr")
    _write(llama, l3, "write_through_selective", [p, p, RESET, p, r], scheduling)
    assert all(page_files(l3.path, prompts["p"], salt)[:9])
    assert not any(page_files(l3.path, prompts["r"], salt))
    p, r = _read_back(prompts, l3, salt)
    assert tiers(p)[1] == HIT and same_output(p, cold["p"])
    assert tiers(r)[1] == 0 and same_output(r, cold["r"])


@SCHEDULINGS
def test_write_back_stores_what_leaves_the_host_tier_and_the_rest_at_shutdown(llama, prompts, cold, l3, salt, scheduling):
    """P and R are 18 pages in a 16-page tier: to save R, P's two oldest pages leave it through
    L3 (R's last two pages may skip the tier, if their slots are still leaving: a save never
    waits); what the host tier holds at the end is written by the worker's close on the
    engine's way out."""
    _write(llama, l3, "write_back", [gen(prompts["p"], salt), gen(prompts["r"], salt)], scheduling)
    assert all(page_files(l3.path, prompts["p"], salt))
    assert all(page_files(l3.path, prompts["r"], salt)[:7])
    p, r = _read_back(prompts, l3, salt)
    assert tiers(p)[1] == HIT and same_output(p, cold["p"])
    assert tiers(r)[1] >= 7 * BLOCK and same_output(r, cold["r"])


@pytest.mark.parametrize("page", [0, 4])
def test_a_corrupt_object_heals_after_one_recompute(prompts, cold, l3, salt, page):
    """Written by one process; the next one reads up to the corrupt object and recomputes the
    rest, rewriting it; a third is served the whole prefix."""
    l3.write([gen(prompts["p"], salt)])
    (obj,) = page_files(l3.path, prompts["p"], salt)[page]
    flip_byte(obj)
    (short,) = l3.read([gen(prompts["p"], salt)])
    assert short["cached"] == page * BLOCK and same_output(short, cold["p"])
    (healed,) = l3.read_again([gen(prompts["p"], salt)])
    assert tiers(healed)[1] == HIT and same_output(healed, cold["p"])
