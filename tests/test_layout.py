"""The package's structure, checked statically (and one fresh interpreter): no import cycle,
imports that run one way between layers, a light worker, and modules and functions short
enough to read."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = "fsdp_bench"
ROOT = REPO / PACKAGE

# Lower layers never import higher ones. A module's layer is that of the longest prefix here
# that names it or a package above it.
LAYERS = {
    "fsdp_bench._version": 0,
    "fsdp_bench.errors": 0,
    "fsdp_bench.config": 1,
    "fsdp_bench.store": 2,
    "fsdp_bench.stats": 2,  # pure: the worker and reports use it
    "fsdp_bench.job": 2,  # may import store (the worker writes records)
    "fsdp_bench.study_storage": 2,
    "fsdp_bench.memory": 3,
    "fsdp_bench.launch": 4,
    "fsdp_bench.sweep": 5,
    "fsdp_bench.search": 5,  # may import sweep
    "fsdp_bench.report": 5,  # but see REPORT_MAY_IMPORT
    "fsdp_bench.cli": 6,
}
# The top package imports lazily through a name -> module table; __main__ is the command.
EXEMPT = {"fsdp_bench", "fsdp_bench.__main__"}
REPORT_MAY_IMPORT = (
    "fsdp_bench.errors",
    "fsdp_bench.config",
    "fsdp_bench.store",
    "fsdp_bench.stats",
    "fsdp_bench.study_storage",
    "fsdp_bench.report",
)
# Pairs of one layer that still import one way only: (importer, what it must not import).
FORBIDDEN = [("fsdp_bench.store", "fsdp_bench.job"), ("fsdp_bench.sweep", "fsdp_bench.search")]

# What a rank of a job must not pay for at import.
HEAVY_FOR_WORKER = ("pandas", "optuna", "seaborn", "matplotlib", "yaml")

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is its __init__.py."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below `node` except those under `if TYPE_CHECKING:` (its else branch is
    walked: that runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.orelse:
                yield branch
                yield from walk_runtime(branch)
            continue
        yield child
        yield from walk_runtime(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def lazy_table() -> dict[str, str]:
    """The top package's name -> module table (`from fsdp_bench import load_results` is an
    import of fsdp_bench.store)."""
    tree = ast.parse(modules()[PACKAGE].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_PUBLIC" for t in node.targets
        ):
            table = ast.literal_eval(node.value)
            assert isinstance(table, dict)
            return table
    return {}


def imports_of(name: str, for_typing: bool = False) -> set[str]:
    """The package modules `name` imports at run time, anywhere in it (functions included);
    `for_typing`: those under `if TYPE_CHECKING:` too."""
    tree = ast.parse(modules()[name].read_text(), filename=str(modules()[name]))
    found: set[str] = set()
    for node in ast.walk(tree) if for_typing else walk_runtime(tree):
        if isinstance(node, ast.Import):
            found.update(_owning_module(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules():  # a submodule
                    found.add(f"{base}.{alias.name}")
                elif base == PACKAGE and alias.name in lazy_table():
                    found.add(lazy_table()[alias.name])
                else:
                    found.add(_owning_module(base))
    return found - {""}


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = importer if is_package(importer) else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _owning_module(name: str) -> str:
    """`name` if it is a module of the package, else the closest package of ours above it;
    "" for a module from outside the package."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return ""
    while name not in modules():
        name = name.rpartition(".")[0]
    return name


@cache
def import_graph(for_typing: bool = False) -> dict[str, frozenset[str]]:
    return {name: frozenset(imports_of(name, for_typing) - {name}) for name in modules()}


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) through each strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, frozenset[str]], component: set[str]) -> list[str]:
    """The shortest cycle from the component's first module back to itself (BFS)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def layer_of(name: str) -> int | None:
    keys = [k for k in LAYERS if name == k or name.startswith(k + ".")]
    return LAYERS[max(keys, key=len)] if keys else None


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("for_typing", [False, True], ids=["run time", "with TYPE_CHECKING"])
def test_no_import_cycle(for_typing: bool) -> None:
    """Not even one hidden under TYPE_CHECKING: two modules that need each other's types are
    one job, or one of them states what it reads (a Protocol)."""
    found = cycles(import_graph(for_typing))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_imports_the_top_level_package() -> None:
    """`fsdp_bench/__init__.py` is the public API: a module importing its names (once
    `__version__`) would run the layers backwards; they import the leaf modules instead."""
    importers = sorted(m for m, targets in import_graph().items()
                       if PACKAGE in targets and m not in EXEMPT)  # fmt: skip
    assert not importers


def test_imports_follow_the_layers() -> None:
    unplaced = sorted(m for m in modules() if m not in EXEMPT and layer_of(m) is None)
    assert not unplaced, f"modules without a layer (add them to LAYERS): {unplaced}"
    bad = []
    for importer, targets in sorted(import_graph().items()):
        if importer in EXEMPT:
            continue
        for target in sorted(targets - EXEMPT):
            ours, theirs = layer_of(importer), layer_of(target)
            assert ours is not None and theirs is not None
            if theirs > ours:
                bad.append(f"{importer} (layer {ours}) -> {target} (layer {theirs})")
            elif _under(importer, "fsdp_bench.report") and not any(
                _under(target, allowed) for allowed in REPORT_MAY_IMPORT
            ):
                bad.append(f"{importer} -> {target} (report imports only {REPORT_MAY_IMPORT})")
            elif any(_under(importer, a) and _under(target, b) for a, b in FORBIDDEN):
                bad.append(f"{importer} -> {target} (forbidden: the other way only)")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_worker_imports_stay_light() -> None:
    code = (
        "import json, sys\n"
        "import fsdp_bench.job.worker\n"
        "roots = {name.partition('.')[0] for name in sys.modules}\n"
        f"print(json.dumps(sorted(roots & set({HEAVY_FOR_WORKER!r}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert heavy == [], f"importing fsdp_bench.job.worker also imports {heavy}"


def test_the_driver_does_not_import_torch() -> None:
    """The driver's modules (the CLI's views, the launchers, the sweep, the estimates' cache
    and pool) import without torch: `fsdp-bench estimate` of a cached grid answers in a
    fraction of a second, and its pool's workers start importing torch at once."""
    code = (
        "import sys\n"
        "import fsdp_bench.cli.views, fsdp_bench.launch, fsdp_bench.sweep, fsdp_bench.memory\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_modules_are_short() -> None:
    long = {
        str(path.relative_to(REPO)): lines
        for path in modules().values()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(long.items())
    )


def test_functions_are_short() -> None:
    long = []
    for path in modules().values():
        for qualname, node in _functions(ast.parse(path.read_text()), ""):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {qualname} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (def to end):\n" + "\n".join(long)


def _functions(
    node: ast.AST, prefix: str
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method below `node`, nested ones included, by qualified name."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{child.name}", child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)
