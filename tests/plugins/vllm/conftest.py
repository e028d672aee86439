"""Real vLLM (CPU build) engines over a small seeded Llama; each engine is its own process,
fresh or pooled for the session (`engines.py`)."""
from __future__ import annotations

import random
import uuid

import pytest

from hicache_vllm.bench.engine import write_llama
from hicache_async.keys import page_hashes

from .engines import RESET, EnginePool, SharedL3, gen

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
def engines():
    """The session's pooled engines, closed at its end."""
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def l3(engines, llama, tmp_path_factory) -> SharedL3:
    """The session's file L3, its writer and two readers."""
    return SharedL3(engines, llama, tmp_path_factory.mktemp("shared-l3"))


@pytest.fixture
def salt() -> str:
    """A cache salt of this test's own: its pages' hashes are no other test's."""
    return uuid.uuid4().hex


@pytest.fixture(scope="session")
def reference(engines, llama):
    """A prompt's cache-less output (no connector, vLLM's prefix cache reset before it), and
    its output served from vLLM's own prefix cache."""
    def outputs(prompt: list[int]) -> tuple[dict, dict]:
        fresh, again = engines.run(llama, [gen(prompt), gen(prompt)])
        assert again["cached"] == len(prompt) // BLOCK * BLOCK
        return fresh, again
    return outputs


@pytest.fixture(scope="session")
def cold(engines, llama, prompts, reference) -> dict[str, dict]:
    """Cache-less outputs of P, Q and R, and P served from vLLM's own prefix cache."""
    p, again = reference(prompts["p"])
    q, r = engines.run(llama, [gen(prompts["q"]), RESET, gen(prompts["r"])])
    return {"p": p, "p_prefix_cache": again, "q": q, "r": r}


def own_prompt(salt: str) -> list[int]:
    """A prompt no other test sends (seeded by the test's salt), as long as P."""
    rng = random.Random(salt)
    return [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)]


def page_files(store, prompt: list[int], salt: str | None = None, page: int = BLOCK) -> list[list]:
    """Each full page's object files under a file store, in page order (several where a model
    has several KV cache groups, one per group that saved the page)."""
    files = [f for f in store.rglob("*") if f.is_file()]
    return [sorted(f for f in files if f.name.startswith(h)) for h in page_hashes(prompt, page, salt=salt)]


def flip_byte(obj) -> None:
    """Corrupt an object file: one bit of its middle byte."""
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x40
    obj.write_bytes(bytes(data))

