"""Steps whose saves overflow the host tier, in real vLLM: eight prompts with prefixes of their
own, sent four at a time (so four requests save in one step) into a 12-page host tier over a
file L3, twice in one engine, then read back one at a time by a new process. Under every
write policy each output equals vLLM's own run of the same request (float32, so batches of
other shapes round alike; threads pinned alike by `vllm_engine`)."""
from __future__ import annotations

import random

import pytest

from hicache_async.config import WRITE_POLICIES

from .engines import RESET, gen, run_engine, same_output, tiers

PAGE_TOKENS = 32
PROMPT_TOKENS = 5 * PAGE_TOKENS + 4     # five full pages each: four prompts are 20 pages a step
HOST_PAGES = 12
SPEC = {"dtype": "float32"}


@pytest.fixture(scope="module")
def crowd() -> list[list[int]]:
    rng = random.Random(36)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(8)]


@pytest.fixture(scope="module")
def alone(llama, crowd) -> list[dict]:
    """vLLM's own run of each prompt, no connector, its prefix cache reset before each."""
    return run_engine(llama, [s for p in crowd for s in (RESET, gen(p))], **SPEC)


def _many(prompts: list[list[int]]) -> dict:
    return {**gen([]), "op": "generate_many", "prompts": prompts}


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_four_requests_a_step_over_a_small_host_tier_give_vllms_own_output(llama, crowd, alone, tmp_path, policy):
    extra = {"storage": "file", "storage_path": str(tmp_path / "store"), "host_pages": HOST_PAGES,
             "write_policy": policy}
    rounds = [_many(crowd[:4]), _many(crowd[4:])]
    written = run_engine(llama, rounds + [RESET] + rounds, extra, **SPEC)
    read = run_engine(llama, [gen(p) for p in crowd], extra, **SPEC)
    for n, out in enumerate(written + read):
        assert same_output(out, alone[n % 8]), (policy, n, tiers(out))
    assert sum(sum(tiers(out)) for out in written[8:]) > 0          # the second round used our tiers
    assert sum(tiers(out)[1] for out in read) > 0                   # the new process read L3
