"""Data flows one way (docs/architecture.md): parse every trainprof module's imports (module-level,
function-level, TYPE_CHECKING ones and literal `importlib.import_module("trainprof...")` calls), give
each module its layer from LAYERS below, and fail on any import of a higher layer and on any cycle."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "trainprof"

# Module (or package prefix) -> layer, lowest first; a module may import its own layer or below. The
# longest matching prefix wins; `trainprof` itself matches only the package root. Within layer 3 the profiler builds on the analysis, never the reverse.
LAYERS: dict[str, float] = {
    # 0: no trainprof imports above this layer: shapes, files, the machine, errors, processes, run dirs
    "trainprof.shapes": 0, "trainprof.io": 0, "trainprof.env": 0, "trainprof.errors": 0,
    "trainprof.distributed": 0, "trainprof.layout": 0, "trainprof.phases": 0,
    "trainprof.recipe": 1,
    "trainprof.models": 2, "trainprof.data": 2, "trainprof.engines": 2, "trainprof.megatron_model": 2,
    "trainprof.megatron_names": 2,
    "trainprof.analysis": 3.0,
    "trainprof.profiler": 3.1, "trainprof.plan": 3.1, "trainprof.plan_pipeline": 3.1, "trainprof.plan_megatron": 3.1,
    "trainprof.report": 4,
    "trainprof.projection": 5,
    "trainprof.sweep": 6, "trainprof.inference": 6, "trainprof.integrations": 6,
    # 7: entry points; `trainprof` itself is the public facade (`from trainprof import Profiler`)
    "trainprof.run": 7, "trainprof.wrap": 7, "trainprof.commands": 7, "trainprof.cli": 7,
    "trainprof.__main__": 7, "trainprof": 7,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(node: ast.AST, name: str, path: Path) -> list[str]:
    """The dotted names one import node (or a literal import_module / __import__ call) refers to."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
            pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        return [base, *(f"{base}.{a.name}" for a in node.names)]  # `from pkg import module` names a module
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return [node.args[0].value]
    return []


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {trainprof module it imports anywhere in its file: the first line that does}."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported_names(node, name, path):
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def layer_of(module: str) -> float | None:
    """The layer of the longest LAYERS prefix of `module` (the package root only for itself)."""
    if module == "trainprof":
        return LAYERS[module]
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each strongly connected component with more than one module, as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_cycle_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_through(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """A path start -> ... -> start inside one strongly connected component (breadth first)."""
    start = min(component)
    parents: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w in component and w not in parents:
                parents[w] = v
                todo.append(w)
    return sorted(component)


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, f"modules without a layer in LAYERS (add them, and to docs/architecture.md): {missing}"


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    upward = [f"{a} (layer {layer_of(a):g}) imports {b} (layer {layer_of(b):g}) at {a.replace('.', '/')}.py:{line}"
              for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
              if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layer order (docs/architecture.md):\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = import_graph()
    found = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
             for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_graph_sees_function_level_imports():
    """The check would be blind if it missed imports inside functions (how cycles usually hide)."""
    graph = import_graph()
    assert "trainprof.io" in graph["trainprof.recipe"]  # imported inside read_yaml only


def test_the_checks_would_catch_an_upward_edge_and_a_cycle():
    """On a made-up graph: an edge from layer 3 up to layer 4 and a two-module cycle are found."""
    graph = {"trainprof.analysis.x": {"trainprof.report.y": 3}, "trainprof.report.y": {"trainprof.report.z": 5},
             "trainprof.report.z": {"trainprof.report.y": 7}}
    assert layer_of("trainprof.analysis.x") < layer_of("trainprof.report.y")
    assert cycles(graph) == [["trainprof.report.y", "trainprof.report.z", "trainprof.report.y"]]
    assert layer_of("trainprof.not_in_the_table") is None  # test_every_module_has_a_layer would name it
