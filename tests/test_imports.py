"""The package imports downward only: no import cycle between its modules (docs/architecture.md).

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` of a
``kdtree_engine`` module, at module level or inside a function, is an edge. Importing a package
runs its ``__init__``, so ``import a.b.c`` / ``from a.b.c import y`` are edges to ``a``, ``a.b``,
``a.b.c`` (and ``a.b.c.y`` when that is a module). Edges from a module to its own enclosing
packages are left out: Python has started those before the module (a package ``__init__`` that
re-exports its modules is no cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import kdtree_engine

ROOT = Path(kdtree_engine.__file__).parent
PKG = "kdtree_engine"


def module_name(path: Path) -> str:
    parts = [PKG, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]  # the package relative imports start from
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets.add(src)
                targets.update(f"{src}.{a.name}" for a in node.names)
        for t in targets:
            # "a.b.c" imports packages a, a.b too (their __init__ run first)
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in mods and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]], ignore=lambda a, b: False) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None. ``ignore(a, b)`` drops edge a -> b."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        color[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if ignore(m, n):
                continue
            if color.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in color and (c := visit(n)):
                return c
        stack.pop()
        color[m] = 2
        return None

    for m in sorted(graph):
        if m not in color and (c := visit(m)):
            return c
    return None


def test_graph_sees_function_level_imports():
    """The walk finds imports inside functions (the demo's lazy model import, for one)."""
    g = import_graph()
    assert "kdtree_engine.model" in g["kdtree_engine.demo"]
    assert "kdtree_engine.kvpool.step" in g["kdtree_engine.kvpool.pool"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def _inside_verify(a: str, b: str) -> bool:
    return a.startswith(f"{PKG}.verify.") and b.startswith(f"{PKG}.verify")


def test_no_import_cycle_outside_verify():
    cycle = find_cycle(import_graph(), ignore=_inside_verify)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_anywhere():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
