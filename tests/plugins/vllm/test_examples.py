"""Every program under examples/ runs as the docs say to run it: the command the README (or
tracing/README.md) gives, else the one in the example's own docstring, from the repository
root, as a user would type it; and the docs name every example."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
DOCS = [REPO / "README.md", REPO / "tracing" / "README.md"]
COMMAND = re.compile(r"(?:\.venv/bin/)?python examples/\w+\.py[^`\n#]*")
EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.py"))
EXPECT = {      # what each example prints when it did its job
    "embed_plugin.py": [r"request \d+: [1-9]\d* cached prompt tokens", r"'tokens_from_l2': [1-9]"],
    "traced_transfer.py": [r"pages written to host"],
    "vllm_connector.py": [r'host tier: +[1-9]\d* cached tokens .*"host_tokens": [1-9]',
                          r'L3, new process: +[1-9]\d* cached tokens .*"l3_tokens": [1-9]', "greedy outputs identical"],
}
TIMEOUT_S = {"vllm_connector.py": 600}     # two vLLM engines on two busy cores: about a minute


def command(example: str) -> str:
    """The docs' command for `example`: the first in a README, else its docstring's."""
    for doc in [*DOCS, REPO / "examples" / example]:
        found = [c.strip() for c in COMMAND.findall(doc.read_text()) if f"examples/{example}" in c]
        if found:
            return found[0]
    raise AssertionError(f"no command runs examples/{example}")


def test_the_docs_name_every_example():
    docs = "".join(doc.read_text() for doc in DOCS)
    assert [e for e in EXAMPLES if f"examples/{e}" not in docs] == []
    assert set(EXPECT) == set(EXAMPLES)


@pytest.mark.timeout(max(TIMEOUT_S.values()) + 60)
@pytest.mark.parametrize("example", EXAMPLES)
def test_each_example_runs_as_the_docs_say(example):
    words = shlex.split(command(example))
    assert Path(words[0]).name == "python" and words[1] == f"examples/{example}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}    # no collector here
    python = words[0] if words[0].startswith(".venv/") else sys.executable   # "python": the project's
    proc = subprocess.Popen([python, *words[1:]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S.get(example, 120))
    finally:        # whatever the example started (vLLM's engines) goes with it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert [s for s in EXPECT[example] if not re.search(s, out)] == [], out[-4000:]
