"""Data flows one way between the recipe and the models, and between the Profiler and its result
document: parse every trainprof module's imports (module-level, function-level and TYPE_CHECKING ones)
and check that neither back edge exists, directly or through other modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "trainprof"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the trainprof modules it imports anywhere in its file."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("upstream, downstream", [
    ("trainprof.recipe", "trainprof.models"),
    ("trainprof.profiler.result", "trainprof.profiler.core"),
])
def test_no_back_edge(upstream, downstream):
    graph = import_graph()
    assert upstream in reachable(graph, downstream), f"{downstream} should use {upstream}"
    assert downstream not in reachable(graph, upstream), (
        f"{upstream} imports {downstream} (directly or through another module): an import cycle")


def test_graph_sees_function_level_imports():
    """The check would be blind if it missed imports inside functions (how cycles usually hide)."""
    graph = import_graph()
    assert "trainprof.io" in graph["trainprof.recipe"]  # imported inside read_yaml only
