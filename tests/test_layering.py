"""kvtier's modules depend one way: no import cycles (counting imports inside functions, not those
under ``TYPE_CHECKING``), and no module imports another's private (``_``-prefixed) names."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

PKG = Path(kvtier.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import in ``path`` outside ``if TYPE_CHECKING:``."""
    found: list[tuple[str, list[str], int]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.extend((a.name, [], node.lineno) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((node.module, [a.name for a in node.names], node.lineno))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt | ast.excepthandler):  # imports in except blocks too
                    visit([child])

    visit(ast.parse(path.read_text()).body)
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(path):
            for target in [f"{module}.{n}" for n in names] + [module]:
                if target in MODULES and target != name:
                    graph[name].add(target)
                    break
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as a path of module names, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := dfs(n)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


def _is_package_init(a: str, b: str) -> bool:
    """``kvtier.x`` (its __init__ re-exports) and ``kvtier.x.y`` (which it imports): not a cycle."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_cycles():
    graph = _graph()
    for a in graph:  # a package's __init__ and its own submodules import each other by design
        graph[a] = {b for b in graph[a] if not _is_package_init(a, b)}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_another_modules_private_names():
    found = [
        f"{_module_name(path)}:{line}: from {module} import {n}"
        for path in MODULES.values()
        for module, names, line in _imports(path)
        if module.startswith("kvtier")
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not found, "\n".join(found)
