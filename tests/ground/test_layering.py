"""The package's layering, read from its source: the ground floor imports nothing above it,
and no two modules import each other, however indirectly. And its map, the README's
"Layout": it names every module and package, names no file that is gone, and its ground
floor is the one held to here."""
from __future__ import annotations

import ast
import itertools
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import hicache_async

PACKAGE = Path(hicache_async.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
GROUND = {f"hicache_async.{name}" for name in (
    "errors", "config", "layout", "request", "keys", "partition", "topology", "kinds", "clock", "events",
    "pools", "daemon_threads", "faults")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports (an imported name that is
    a module counts as that module; any other as the module it comes from)."""
    sources = {_module_name(path): path for path in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in sources.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:     # relative: from the package, level - 1 steps up
                    base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0], node.module]))
                deps |= {owner(f"{base}.{alias.name}") for alias in node.names}
        graph[module] = deps - {None, module}
    return graph


def test_the_graph_sees_the_imports_it_judges():
    graph = import_graph()
    assert GROUND <= graph.keys()
    assert "hicache_async.errors" in graph["hicache_async.transfer.page_store"]
    assert "hicache_async.hicache.ledger" in graph["hicache_async.hicache.plugin"]


def test_the_ground_floor_imports_nothing_above_it():
    graph = import_graph()
    upward = {module: sorted(graph[module] - GROUND) for module in GROUND if graph[module] - GROUND}
    assert upward == {}


def test_no_import_circles():
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def _layout() -> str:
    """The code block of the README's Layout section."""
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("## Layout"):].split("```")[1]


def test_every_module_and_package_is_on_the_map():
    words = set(re.findall(r"\w+", _layout()))
    sources = [path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts]
    modules = {path.stem for path in sources if path.stem not in ("__init__", "__main__")}
    packages = {path.parent.name for path in sources if path.name == "__init__.py"}
    assert sorted(modules - words) == []
    assert sorted(packages - words) == []


def test_every_file_the_map_names_exists():
    named = set(re.findall(r"(\w+)\.py", _layout()))
    existing = {path.stem for path in PACKAGE.rglob("*.py")}
    assert sorted(named - existing) == []


def test_the_maps_ground_floor_is_the_tested_one():
    lines = _layout().splitlines()
    at = next(i for i, line in enumerate(lines) if "ground floor" in line)
    floor = " ".join(itertools.takewhile(lambda line: line.startswith("    "), lines[at + 1:]))
    assert {f"hicache_async.{name}" for name in re.findall(r"(\w+)\.py", floor)} == GROUND
