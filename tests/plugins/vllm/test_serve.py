"""`vllm serve` with the connector, as the README says to run it, over HTTP: the README's own
line (read from it, so the two cannot drift) serves a shared prefix from our host tier, and a
SIGTERM lets the workers flush the backups still under way before the server exits."""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
from pathlib import Path

from tests.helpers.installed_backend import installed_backend_env

from .conftest import page_files
from .servers import Server, metric, serving

README = Path(__file__).parents[3] / "README.md"
SHARED = 7 * 32     # the second prompt shares the first seven 32-token pages


def cache_home(tmp_path: Path) -> dict:
    """A cache home of the test's own, where the README's L3 lands; vLLM's own cache stays the
    session's (under a fresh one vLLM inspects the model class again, in a process of its own:
    about ten seconds of vLLM's imports a server)."""
    vllm_cache = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    return {"XDG_CACHE_HOME": str(tmp_path), "VLLM_CACHE_ROOT": vllm_cache}


def readme_serve_line() -> tuple[dict, list[str]]:
    """The environment and the flags of the `vllm serve MODEL` line in "Use it in vLLM"."""
    section = README.read_text().split("## Use it in vLLM", 1)[1].split("\n## ", 1)[0]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "vllm serve" in b)
    words = shlex.split(block.replace("\\\n", " "))
    at = words.index("vllm")
    assert words[at:at + 3] == ["vllm", "serve", "MODEL"], words
    return dict(w.split("=", 1) for w in words[:at]), words[at + 3:]


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(5)
    out = {name: [rng.randrange(3, 1000) for _ in range(300)] for name in ("P", "F1", "F2", "F3", "F4")}
    out["Q"] = out["P"][:SHARED] + [rng.randrange(3, 1000) for _ in range(300 - SHARED)]
    return out


def test_the_readmes_serve_line_serves_a_shared_prefix_from_the_host_tier(llama, tmp_path):
    env, args = readme_serve_line()
    assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector"] == "HiCacheConnector"
    prompts = _prompts()
    with serving(llama, args, tmp_path / "server.log", {**env, **cache_home(tmp_path)}) as server:
        for name in ("P", "F1", "F2", "F3", "F4"):      # four prompts push P out of vLLM's device cache
            server.complete(prompts[name])
        shared = server.complete(prompts["Q"])["kv_transfer_params"]["hicache"]
        assert shared["host_tokens"] == SHARED and shared["l3_tokens"] == 0
        text = server.metrics()
        assert metric(text, "vllm:hicache_prefix_tokens_total", tier="host", engine="0") == SHARED
        assert server.stop(signal.SIGTERM) == 0
    store = tmp_path / "hicache-async" / "kv"      # the README's L3: no storage_path, the user's cache
    assert all(page_files(store, prompts["P"])[:9])


def test_sigterm_flushes_backups_still_under_way(llama, tmp_path):
    """Each write waits 3 s before it lands: the SIGTERM comes while P's backup is still
    waiting, and the server exits only once it landed (vLLM's windows as the README sets them)."""
    env, args = readme_serve_line()
    extra = {"storage": "slowfile", "storage_timeout": 20, "flush_timeout": 20}
    transfer = {**json.loads(args[args.index("--kv-transfer-config") + 1]), "kv_connector_extra_config": extra}
    args[args.index("--kv-transfer-config") + 1] = json.dumps(transfer)
    env = {**installed_backend_env(tmp_path, "slowfile", "tests.plugins.vllm.slow_file:SlowFileWrites"), **env,
           **cache_home(tmp_path), "HICACHE_SLOW_WRITE_S": "3"}
    prompt = _prompts()["P"]
    store = tmp_path / "hicache-async" / "kv"
    server = Server(llama, args, tmp_path / "server.log", env)
    try:
        server.wait_ready().complete(prompt)
        assert not any(page_files(store, prompt))         # the backup is still waiting to write
        assert server.stop(signal.SIGTERM) == 0
    finally:
        server.kill()
    assert all(page_files(store, prompt)[:9]), server.tail()
    assert "abandoned" not in server.log.read_text()
