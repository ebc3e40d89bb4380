"""``layertap/`` has no import cycle, neither between its files nor between its subpackages and top-level
modules taken as units (``data/``, ``engines/``, ``models/``, ``state/``, ``store/``, ``tiny/``, ``spec.py``...).
Every import counts, those inside functions and under ``TYPE_CHECKING`` too: a lazy import still ties two
modules together for a reader. Each module of ``benchmarks/`` imports (they import one another and the harness)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "layertap"


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def module_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from a.b import c`` points at ``a.b.c`` when that is a module)."""

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names if a.name.split(".")[0] == "layertap"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("layertap"):
                base = node.module or ""
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
        graph[name] = targets - {name}
    return graph


def unit_of(module: str) -> str:
    """A subpackage is one unit; a top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for source, targets in graph.items():
        units.setdefault(unit_of(source), set()).update(unit_of(t) for t in targets)
    return {u: targets - {u} for u, targets in units.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected group of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(_path_through([v, *group], graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A concrete cycle inside a strongly connected group, for the failure message: start -> ... -> start."""
    members, start = set(group), group[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, set()) & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return group


def test_no_cycle_between_modules() -> None:
    found = cycles(module_graph(module_files()))
    assert not found, "import cycles between modules: " + "; ".join(" -> ".join(c) for c in found)


def test_no_cycle_between_units() -> None:
    found = cycles(unit_graph(module_graph(module_files())))
    assert not found, "import cycles between subpackages/modules: " + "; ".join(" -> ".join(c) for c in found)


def test_the_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


BENCHMARKS = sorted((ROOT / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_benchmark_module_imports(path: Path) -> None:
    """What ``python -m benchmarks...`` imports before it parses its options (the harness's names included)."""
    importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
