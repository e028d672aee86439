"""The package's layering, read from its source: the ground floor imports nothing above it,
no two modules import each other, however indirectly, and the core imports no engine (each
engine's code lives in its plugin). And its map, the README's "Layout": it names every package
of the core and the plugins, and every module in its own package's entry, names no file that
is gone, and its ground floor is the one held to here."""
from __future__ import annotations

import ast
import itertools
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

import hicache_async

PACKAGE = Path(hicache_async.__file__).parent
REPO = PACKAGE.parent
TREES = {   # each top entry of the map -> the package folder it describes
    "hicache_async": PACKAGE,
    "plugins/vllm": REPO / "plugins/vllm/hicache_vllm",
    "plugins/sglang": REPO / "plugins/sglang/hicache_sglang",
}
ENGINES = {"vllm", "sglang", "dynamo", "hicache_vllm", "hicache_sglang"}     # what the core may not import
GROUND = {f"hicache_async.{name}" for name in (
    "errors", "config", "layout", "request", "keys", "partition", "topology", "kinds", "clock", "events",
    "pools", "daemon_threads", "faults", "fingerprint", "ports")}


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


def _map() -> dict[str, str]:
    """The README Layout's text about each entry, by its path: an entry `name/` opens a folder,
    nested by its indent under the entry above it (`hicache_async/app/bench`,
    `plugins/vllm/bench`); file lines (`api.py`, the ground floor) belong to `hicache_async`."""
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("## Layout"):].split("```")[1]
    texts: dict[str, str] = {}
    opened: dict[int, str | None] = {}    # indent -> the entry opened at it
    current = None
    for line in block.splitlines():
        indent, head = len(line) - len(line.lstrip()), (line.split() or [""])[0]
        if head.endswith("/"):
            parent = "" if indent == 0 else opened.get(indent - 2)
            current = None if parent is None else f"{parent}/{head[:-1]}".lstrip("/")
            opened[indent] = current
        elif head.rstrip(",").endswith(".py") and indent <= 4 and opened.get(0) == "hicache_async":
            current = "hicache_async"
        if current is not None:
            texts[current] = texts.get(current, "") + line + "\n"
    return texts


def _sources() -> dict[str, set[str]]:
    """The modules of each folder of the core and the plugins, by its entry's path on the map."""
    out: dict[str, set[str]] = {}
    for entry, root in TREES.items():
        for path in root.rglob("*.py"):
            folder = path.parent.relative_to(root).as_posix()
            out.setdefault(entry if folder == "." else f"{entry}/{folder}", set()).add(path.stem)
    return out


def test_every_plugin_is_a_tree_the_map_is_held_to():
    plugins = {f"plugins/{init.parent.parent.name}": init.parent for init in REPO.glob("plugins/*/*/__init__.py")}
    assert plugins == {entry: root for entry, root in TREES.items() if entry.startswith("plugins/")}


def test_every_package_and_module_is_on_the_map_under_its_own_package():
    texts, sources = _map(), _sources()
    assert sorted(sources.keys() - texts.keys()) == []
    unnamed = {package: sorted(modules - {"__init__", "__main__"} - set(re.findall(r"\w+", texts[package])))
               for package, modules in sources.items()}
    assert {package: names for package, names in unnamed.items() if names} == {}


def test_every_file_the_map_names_exists():
    texts, sources = _map(), _sources()
    gone = {package: sorted(set(re.findall(r"(\w+)\.py", text)) - sources.get(package, set()))
            for package, text in texts.items() if package.startswith(tuple(TREES))}
    assert {package: names for package, names in gone.items() if names} == {}


def test_the_maps_ground_floor_is_the_tested_one():
    lines = _map()["hicache_async"].splitlines()
    at = next(i for i, line in enumerate(lines) if "ground floor" in line)
    floor = " ".join(itertools.takewhile(lambda line: line.startswith("    "), lines[at + 1:]))
    assert {f"hicache_async.{name}" for name in re.findall(r"(\w+)\.py", floor)} == GROUND


def _engine_imports(path: Path) -> list[str]:
    """The engines `path` imports: by `import`/`from`, or by name (`import_module`, `find_spec`)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module or "")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "find_spec", "__import__")):
            names.append(node.args[0].value)
    return sorted({name for name in names if name.split(".")[0] in ENGINES})


def test_the_core_imports_no_engine():
    found = {path.relative_to(REPO).as_posix(): _engine_imports(path) for path in PACKAGE.rglob("*.py")}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_engine_check_sees_each_way_of_importing_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import vllm.config\nfrom sglang.srt import x\nfrom . import dynamo\n"
                     "importlib.import_module('hicache_vllm.bench')\nimportlib.util.find_spec('dynamo')\n"
                     "import hicache_sglangish\n")
    assert _engine_imports(probe) == ["dynamo", "hicache_vllm.bench", "sglang.srt", "vllm.config"]
