"""In real vLLM, KV never crosses what decides it: LoRA adapters (host tier and L3 across
processes), prompt embeddings, new weights saved over the model folder, and dummy weights
loaded over the real one. Each output is
compared with the same request run without the connector, or under a cache salt nothing in our
tiers matches (LoRA and prompt embeddings, in the pooled LoRA reader; the new weights, in their
own engine): vLLM computes it alone, as without us."""
from __future__ import annotations

import os
import shutil
import uuid

import pytest

from hicache_vllm.bench.engine import write_llama, write_lora

from .conftest import BLOCK, SHARED_PAGES, page_files
from .engines import RESET, gen, run_engine, same_output, tiers

HIT = 288                   # nine full blocks of a 300-token prompt
LORA = {"lora_rank": 8, "prompt_embeds": True}      # LoRA and prompt embeddings on


def embeds(seed: int, salt: str | None = None) -> dict:
    return {"op": "generate", "embeds_seed": seed, "embeds_len": 300, "salt": salt, "max_tokens": 8, "logprobs": 3}


def _lora_engine(engines, llama, l3, steps: list[dict], process: str) -> list[dict]:
    """A pooled engine with LoRA and prompt embeddings on, over the shared L3."""
    return engines.run(llama, steps, l3.extra, process=process, **LORA)


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory) -> dict[str, list]:
    """Two adapters in folders as a training run leaves them: beside what vLLM loads, a 64 MiB
    optimizer state, a `.git` folder and a dangling link (none of which names the adapter)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, name in enumerate("ab"):
        folder = write_lora(root / name, llama, seed=i + 1)
        (folder / "optimizer.pt").write_bytes(os.urandom(64 << 20))
        (folder / ".git").mkdir()
        (folder / ".git" / "HEAD").write_text("ref: refs/heads/main")
        (folder / "checkpoint-100").symlink_to(root / "deleted-checkpoint")
        out[name] = [name, i + 1, str(folder)]
    return out


@pytest.fixture(scope="module")
def cold_lora(engines, llama, prompts, adapters, l3) -> dict[str, dict]:
    """Q under each adapter, and two prompt embeddings, as vLLM computes them alone: in the
    pooled LoRA reader, under a fresh cache salt each (nothing in our tiers matches it)."""
    q = prompts["q"]
    a, b, e1, e2 = (uuid.uuid4().hex for _ in range(4))
    out = _lora_engine(engines, llama, l3, [gen(q, a) | {"lora": adapters["a"]}, RESET,
                                            gen(q, b) | {"lora": adapters["b"]}, RESET, embeds(1, e1), RESET,
                                            embeds(2, e2)], "reader")
    assert [o["cached"] for o in out] == [0] * 4
    return dict(zip(["a", "b", "e1", "e2"], out))


def test_adapters_never_share_kv_and_each_gets_its_own_back(engines, llama, prompts, cold, cold_lora, adapters,
                                                            l3, salt):
    """Base P, then Q (sharing P's first pages) under adapters a and b: no page crosses; Q
    under a again comes from the host tier, and a new process gets b's and the base's own
    pages from L3."""
    p, q = gen(prompts["p"], salt), gen(prompts["q"], salt)
    base, a, b, a_again = _lora_engine(engines, llama, l3, [p, RESET, q | {"lora": adapters["a"]}, RESET,
                                                            q | {"lora": adapters["b"]}, RESET,
                                                            q | {"lora": adapters["a"]}], "writer")
    assert same_output(base, cold["p"])
    assert a["cached"] == 0 and same_output(a, cold_lora["a"])
    assert b["cached"] == 0 and same_output(b, cold_lora["b"])
    assert tiers(a_again)[0] == HIT and same_output(a_again, cold_lora["a"])
    b_l3, base_q = _lora_engine(engines, llama, l3, [q | {"lora": adapters["b"]}, RESET, q], "reader")
    assert tiers(b_l3)[1] == HIT and same_output(b_l3, cold_lora["b"])
    assert tiers(base_q)[1] == SHARED_PAGES * BLOCK and same_output(base_q, cold["q"])


def test_prompt_embeddings_key_their_pages(engines, llama, cold_lora, l3, salt):
    """Two prompts of one length and other embeddings (their placeholder token ids are all
    equal) share nothing; the first one's own pages come back."""
    e1, e2, again = _lora_engine(engines, llama, l3, [embeds(1, salt), RESET, embeds(2, salt), RESET,
                                                      embeds(1, salt)], "writer")
    assert same_output(e1, cold_lora["e1"])
    assert e2["cached"] == 0 and same_output(e2, cold_lora["e2"])
    assert tiers(again)[0] == HIT and same_output(again, cold_lora["e1"])


def test_prompt_logprobs_take_nothing_from_our_tiers(prompts, cold, l3, salt):
    p = gen(prompts["p"], salt)
    _, scored = l3.write([p, RESET, p | {"prompt_logprobs": 1}])
    assert scored["cached"] == 0 and tiers(scored) == (0, 0)
    assert same_output(scored, cold["p"])


def test_new_weights_in_the_same_folder_miss_l3(prompts, tmp_path):
    """A fine-tune saved over the model folder: a new process gets nothing of the old KV."""
    model = tmp_path / "model"
    shape = dict(layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, intermediate=512, logit_scale=4.0)
    write_llama(model, seed=0, **shape)
    extra = {"storage": "file", "storage_path": str(tmp_path / "store")}
    (old,) = run_engine(model, [gen(prompts["p"])], extra)
    shutil.rmtree(model)
    write_llama(model, seed=7, **shape)
    # then P under a fresh cache salt, which nothing in our tiers matches: vLLM's own output of the
    # new weights, without an engine of its own
    new, reference = run_engine(model, [gen(prompts["p"]), RESET, gen(prompts["p"], uuid.uuid4().hex)], extra)
    assert old["params"]["hicache"]["model"] != new["params"]["hicache"]["model"]
    assert new["cached"] == 0 and same_output(new, reference) and reference["cached"] == 0
    assert old["tokens"] != new["tokens"]


def test_dummy_weights_over_the_real_folder_never_serve_the_real_model(llama, prompts, cold, l3, salt):
    """`--load-format dummy` over the real checkpoint folder computes other KV into the same
    store: the real weights (a new process, the session's reader) then get none of it, and
    vLLM's own tokens."""
    p = gen(prompts["p"], salt)
    (dummy,) = run_engine(llama, [p], l3.extra, load_format="dummy")
    assert len(sum(page_files(l3.path, prompts["p"], salt), [])) >= HIT // BLOCK    # its pages are in L3
    assert dummy["tokens"] != cold["p"]["tokens"]                                 # and would show if served
    (real,) = l3.read([p])
    assert dummy["params"]["hicache"]["model"] != real["params"]["hicache"]["model"]
    assert real["cached"] == 0 and tiers(real) == (0, 0) and same_output(real, cold["p"])
