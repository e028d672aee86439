"""The processes the suite starts, counted by what they run, each start said in one line on
stderr (a failing test shows its own). An audit hook sees every `subprocess` start in this
process whoever makes it: engines, servers, Mooncake masters, indexers, CLI runs. Spawned rank
processes are not subprocesses; SGLang's controllers are threads, counted where they are built."""
from __future__ import annotations

import os
import sys
from collections import Counter

STARTS: Counter[str] = Counter()

NAMES = {   # a module (`python -m M`) or a program, as the summary names it
    "hicache_async": "hicache-async CLI", "hicache-async": "hicache-async CLI",
    "hicache_vllm.bench.engine": "vLLM engine", "vllm.entrypoints.openai.api_server": "vLLM server",
    "dynamo.indexer": "Dynamo indexer", "hicache_mooncake.holder": "Mooncake segment holder",
    "hicache_vllm.bench.forkserver": "fork server",
}


def kind_of(argv: list[str]) -> str:
    """`python -m M` is M; `python -c` and `python SCRIPT` say so; any other program is its name."""
    program = os.path.basename(argv[0])
    if program.startswith("python") and len(argv) > 1:
        name = argv[2] if argv[1] == "-m" and len(argv) > 2 else f"python {'-c' if argv[1] == '-c' else argv[1]}"
    else:
        name = program
    return NAMES.get(name, name)


def started(kind: str, what: str = "") -> None:
    """Count a start of `kind` and say so in one line (`what`: its command or settings, cut short)."""
    STARTS[kind] += 1
    print(f"started {kind} #{STARTS[kind]}{': ' if what else ''}{what[:160]}", file=sys.stderr)


def _audit(event: str, args: tuple) -> None:
    if event == "subprocess.Popen":
        argv = [os.fsdecode(a) for a in ([args[1]] if isinstance(args[1], (str, bytes, os.PathLike)) else args[1])]
        started(kind_of(argv), " ".join(argv))


def count_subprocesses() -> None:
    """Count every subprocess this process starts from now on (an audit hook stays for good)."""
    sys.addaudithook(_audit)


def summary(counts: Counter[str]) -> str:
    return "processes started: " + ", ".join(f"{n} {kind}" for kind, n in counts.most_common())
