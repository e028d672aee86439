"""Real vLLM (CPU build) engines over a small seeded Llama; each engine is its own process."""
from __future__ import annotations

import random

import pytest

from hicache_async.app.bench.vllm_engine import write_llama
from hicache_async.keys import page_hashes

from .engines import RESET, gen, run_engine

BLOCK = 32
PROMPT_TOKENS = 300     # nine full blocks: the hit is 288 tokens
SHARED_PAGES = 7        # the second prompt shares the first seven blocks


@pytest.fixture(scope="session")
def llama(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama") / "model", layers=4, hidden=256, heads=4, kv_heads=2,
                       vocab=1024, intermediate=512, logit_scale=4.0)


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(1)
    p = [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]
    q = p[:SHARED_PAGES * BLOCK] + [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS - SHARED_PAGES * BLOCK)]
    r = [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]
    return {"p": p, "q": q, "r": r}


@pytest.fixture(scope="session")
def cold(llama, prompts) -> dict[str, dict]:
    """Cache-less outputs (no connector, vLLM's prefix cache reset before each), and P served
    from vLLM's own prefix cache."""
    p, again, q, r = run_engine(llama, [gen(prompts["p"]), gen(prompts["p"]), RESET, gen(prompts["q"]), RESET,
                                        gen(prompts["r"])])
    assert again["cached"] == 288
    return {"p": p, "p_prefix_cache": again, "q": q, "r": r}


def page_files(store, prompt: list[int], salt: str | None = None) -> list[list]:
    """Each full page's object files under a file store, in page order."""
    files = [f for f in store.rglob("*") if f.is_file()]
    return [sorted(f for f in files if f.name.startswith(h)) for h in page_hashes(prompt, BLOCK, salt=salt)]
