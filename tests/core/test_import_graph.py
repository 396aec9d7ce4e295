"""The import graph of ``framework/engine/`` and ``framework/distributed/``: the engine builds on
the distributed layer, never the other way round, and no two modules import each other (directly
or around a longer circle), counting imports inside functions; imports only for type checkers
(``if TYPE_CHECKING:``) do not count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("framework/engine", "framework/distributed")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, known: set[str]) -> set[str]:
    """The ``known`` modules a module imports (at any depth, TYPE_CHECKING blocks left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # ``from package import module`` imports the module; else the package's names
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & known


def import_graph() -> dict[str, set[str]]:
    paths = [path for package in PACKAGES for path in sorted((ROOT / package).glob("*.py"))]
    names = {_module_name(path): path for path in paths}
    return {name: _imports(ast.parse(path.read_text()), set(names)) - {name} for name, path in names.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (as a path that ends where it starts), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (found := walk(target)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_distributed_layer_imports_nothing_from_the_engine():
    graph = import_graph()
    assert {"framework.engine.builder", "framework.distributed.state"} <= set(graph)  # the walk found the modules
    upward = {
        name: sorted(t for t in targets if t.startswith("framework.engine"))
        for name, targets in graph.items()
        if name.startswith("framework.distributed")
    }
    assert not {name: targets for name, targets in upward.items() if targets}


def test_no_import_circle_between_engine_and_distributed_modules():
    assert _cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
