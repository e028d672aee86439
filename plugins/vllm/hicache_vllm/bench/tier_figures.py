"""vLLM figures: TTFT of a 2,000-token prompt whose 1,984-token prefix comes from each place a
real vLLM engine (CPU build) can take it, each beside vLLM's own prefix cache in the same run.

Every TTFT is one `generate` with max_tokens=1, the median of a few repetitions after one
warm-up, each engine a fresh process over the same seeded 8-layer Llama on the same cores
and thread count (`engine`):
- prefix cache: a plain engine, the prompt repeated (the baseline);
- no cache: the same engine, its prefix cache reset before each repetition;
- host tier: `HiCacheConnector` with storage none, vLLM's prefix cache reset before each;
- L3: a writer process fills a file store with distinct prompts; a new reader process over it
  asks for each once, so every repetition's pages are in L3 alone (never in vLLM's cache or our
  host tier), each object verified before it becomes KV. Its warm-up is a new prompt sharing
  only the first prompt's 1,920-token prefix, which L3 serves as well;
- `ExampleConnector` (vLLM's in-tree disk store, unverified): the prompt repeated, prefix cache
  reset before each, so each reads its store; then a new prompt sharing the prefix, which its
  whole-prompt keys cannot serve.
"""
from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path

from hicache_async.app.bench.figure import figure
from hicache_async.errors import HiCacheError

from . import require_vllm

BLOCK, PREFIX, PROMPT = 32, 1_920, 2_000
HIT = (PROMPT - 1) // BLOCK * BLOCK             # 1,984: every full block but the one the last token needs
BASELINE = "vllm_prefix_cache_ttft_s"
NAMES = ("vllm_host_tier_ttft_s", "vllm_l3_file_ttft_s", "vllm_example_connector_ttft_s", "vllm_no_cache_ttft_s",
         "vllm_l3_vs_example_connector_ttft_s", "vllm_shared_prefix_cached_tokens")


def vllm_figures(quick: bool = False) -> list[dict]:
    require_vllm()
    from .engine import run_engine, write_llama

    reps = 2 if quick else 5
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 2_000) for _ in range(n)]

    p = [tokens(PROMPT) for _ in range(reps + 1)]                  # distinct prompts
    prompts = {"w": tokens(64), "q": p[0][:PREFIX] + tokens(PROMPT - PREFIX),
               **{f"p{i}": x for i, x in enumerate(p)}}
    with tempfile.TemporaryDirectory(prefix="hicache-vllm-bench-") as root:
        base = {"model": str(write_llama(Path(root) / "llama")), "block_size": BLOCK, "prompts": prompts}

        def engine(steps: list, connector: str | None = None, **extra) -> list[dict]:
            steps = [{"op": "reset"} if op == "reset" else {"op": "generate", "prompt": name[0]}
                     for op, *name in steps]
            return run_engine({**base, "connector": connector, "extra": extra, "steps": steps})

        plain = engine([["gen", "w"]] + [["reset"], ["gen", "p1"]] * reps + [["gen", "p1"]] * (reps + 1))
        cold, cached = plain[1:reps + 1], plain[reps + 2:]
        host = engine([["gen", "p1"]] + [["reset"], ["gen", "p1"]] * (reps + 1), "HiCacheConnector",
                      storage="none")[2:]
        l3 = {"storage": "file", "storage_path": f"{root}/l3"}
        engine([["gen", f"p{i}"] for i in range(reps + 1)], "HiCacheConnector", **l3)
        shared, *from_l3 = engine([["gen", "q"]] + [["gen", f"p{i}"] for i in range(1, reps + 1)],
                                  "HiCacheConnector", **l3)
        example = engine([["gen", "p1"]] + [["reset"], ["gen", "p1"]] * (reps + 1) + [["reset"], ["gen", "q"]],
                         "ExampleConnector", shared_storage_path=f"{root}/example")
        example, example_shared = example[2:-1], example[-1]
    _check("prefix cache", cached, lambda r: r["cached"] == HIT)
    _check("no cache", cold, lambda r: r["cached"] == 0)
    _check("host tier", host, lambda r: _tier(r, "host_tokens") == r["cached"] > 0)
    _check("L3", from_l3, lambda r: _tier(r, "l3_tokens") == r["cached"] > 0)
    _check("ExampleConnector", example, lambda r: r["cached"] == HIT)
    base_s, host_s, l3_s, example_s = (_ttft(r) for r in (cached, host, from_l3, example))
    return [_noted(figure(NAMES[0], host_s, "s", BASELINE, base_s), 1.2, host),
            _noted(figure(NAMES[1], l3_s, "s", BASELINE, base_s), 1.5, from_l3),
            _noted(figure(NAMES[2], example_s, "s", BASELINE, base_s), None, example),
            _noted(figure(NAMES[3], _ttft(cold), "s", BASELINE, base_s), None, cold),
            _noted(figure(NAMES[4], l3_s, "s", NAMES[2], example_s), 1.0, from_l3),
            figure(NAMES[5], shared["cached"], "tokens", "vllm_example_connector_shared_prefix_cached_tokens",
                   example_shared["cached"])]


def _ttft(results: list[dict]) -> float:
    return statistics.median(r["seconds"] for r in results)


def _tier(result: dict, key: str) -> int:
    """Tokens our connector says it served from one tier (its `kv_transfer_params`)."""
    return ((result["params"] or {}).get("hicache") or {}).get(key, 0)


def _check(what: str, results: list[dict], ok) -> None:
    """A repetition its source did not serve would time something else: stop, naming it."""
    bad = [r for r in results if not ok(r)]
    if bad:
        raise HiCacheError(f"vllm bench: {what} did not serve the prefix: cached {bad[0]['cached']}, "
                           f"params {bad[0]['params']}")


def _noted(fig: dict, max_ratio: float | None, results: list[dict]) -> dict:
    """The issue's goal line for this figure as a boolean, and the tokens each repetition took."""
    fig["cached_tokens"] = [r["cached"] for r in results]
    if max_ratio is not None:
        fig["goal_max_ratio"], fig["goal_met"] = max_ratio, fig["ratio"] <= max_ratio
    return fig
