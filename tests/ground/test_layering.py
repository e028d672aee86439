"""The package's layering, read from its source: the ground floor imports nothing above it,
and no two modules import each other, however indirectly (README, "Layout")."""
from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import hicache_async

PACKAGE = Path(hicache_async.__file__).parent
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
