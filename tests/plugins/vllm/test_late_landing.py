"""Copies that land a step late, in real vLLM (`late_copies`: as on a GPU, where a save lands on
an event steps after it was issued): vLLM keeps a finished request's blocks until its saves
landed (`request_finished` True, `get_finished` later), and preempts a request while its saves
are in flight. Three 316-token prompts sent together fill a KV cache of 30 blocks; their fifth
decoded token needs an eleventh block each, so vLLM preempts one of them, whose page completed
the step before is still being saved (each worker fences it), and resumes it once blocks are
free, taking from our host tier the pages vLLM's own cache gave away. A fourth prompt of ten
whole pages asks for one token: it finishes in the step that saves its pages, so vLLM keeps its
blocks until the workers report them landed, a step later. The same steps run under vLLM's
scheduling as on CPU and as on a GPU (async: the scheduler a step ahead of the worker). Every
output is compared with vLLM's own run of the same steps with the same KV cache and scheduling
(no connector, float32): the three together and the fourth exactly, tokens and top-3 logprobs.
Each prompt read back alone from the host tier loads KV computed in the batch of three, which
on some CPUs differs from a lone prompt's by float32 rounding (logprobs moved by 7.9e-6 under
async scheduling on an AVX2 EPYC; exact where the last session's CI ran): its tokens exactly,
its logprobs within 1e-3.
"""
from __future__ import annotations

import random

import pytest

from .engines import RESET, SCHEDULINGS, close_output, gen, run_engine, same_output, tiers

PAGE_TOKENS = 32
PROMPT_TOKENS = 9 * PAGE_TOKENS + 28    # the fifth decoded token starts an eleventh block
BLOCK_BYTES = 4 * 2 * PAGE_TOKENS * 2 * 64 * 4      # layers, K and V, tokens, kv heads, head dim, float32
SPEC = {"dtype": "float32", "kv_bytes": 31 * BLOCK_BYTES, "max_len": 11 * PAGE_TOKENS}   # 30 blocks and vLLM's null one
EXTRA = {"storage": "none", "host_pages": 64, "late_copies": True}


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    """The three prompts together, the fourth, then each of the three alone; vLLM's prefix
    cache reset before each but the batch (a reset while vLLM still keeps the fourth's blocks
    for us does nothing; the next ones do)."""
    rng = random.Random(41)
    trio = [[rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)] for _ in range(3)]
    whole = {**gen([rng.randrange(3, 1000) for _ in range(10 * PAGE_TOKENS)]), "max_tokens": 1}
    return [{**gen([]), "op": "generate_many", "prompts": trio}, RESET, whole,
            *(s for p in trio for s in (RESET, gen(p)))]


@SCHEDULINGS
def test_late_landings_and_a_preemption_give_vllms_own_output(llama, steps, scheduling):
    """Under vLLM's CPU scheduling the preemption comes while the page its request completed the
    step before is being saved (fenced); under async scheduling it came here once those saves
    had landed. Either way the preempted request resumes with pages from the host tier."""
    ours = run_engine(llama, steps, EXTRA, **SPEC, **scheduling)
    own = run_engine(llama, steps, **SPEC, **scheduling)
    fenced = [out["params"]["hicache"]["fenced_preemptions"] for out in ours[:3]]
    if not scheduling:
        assert sum(fenced) >= 1, f"no request was preempted while its saves were in flight: {fenced}"
        assert all(tiers(out)[0] for out, n in zip(ours, fenced) if n), "a fenced request resumed without our pages"
    assert any(tiers(out)[0] for out in ours[:3]), "no preempted request resumed from the host tier"
    for n, (out, want) in enumerate(zip(ours[:4], own)):
        assert same_output(out, want), (n, fenced, tiers(out))
    assert tiers(ours[3]) == (0, 0)
    for n, (out, want) in enumerate(zip(ours[4:], own[4:])):
        assert tiers(out) == (9 * PAGE_TOKENS, 0), (n, tiers(out))       # every prompt page, from the host tier
        assert close_output(out, want), (n, tiers(out))
