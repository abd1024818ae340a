"""kvtier's modules depend one way and keep their private names to themselves:

* no import cycle among kvtier's modules, counting imports inside functions and those under
  ``if TYPE_CHECKING:`` (a cycle of type-only imports is still a cycle of the design);
* no kvtier module imports another's private (``_``-prefixed) names;
* no test reaches into kvtier's private names: neither ``from kvtier.x import _y`` nor reading,
  writing or patching ``obj._y`` where ``_y`` is a private name kvtier defines (tests use the public
  surface; the ``_``-prefixed names a test file or a helper module of tests/ defines are theirs).

::

    kvtier/**.py ──imports──▶ graph ──▶ cycles (one per strongly connected group)
    tests/**.py  ──AST──────▶ `from kvtier.. import _y`, `x._y`, getattr/setattr(x, "_y"),
                              monkeypatch.setattr("kvtier.m._y", ..)  ──▶ file:line list
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

PKG = Path(kvtier.__file__).resolve().parent
ROOT = PKG.parent
TESTS = ROOT / "tests"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}
TEST_FILES = sorted(TESTS.rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every absolute import in ``path``: at the top, inside
    functions, in ``except`` blocks and under ``if TYPE_CHECKING:``."""
    found: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [a.name for a in node.names], node.lineno))
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per group of modules that all reach each other (a strongly connected component
    of more than one module), so that a failure names every tangle, not only the first."""
    reach: dict[str, set[str]] = {}
    for m in graph:  # the graph is a few hundred modules: plain reachability is fast enough
        seen, todo = set(), list(graph[m])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(graph[n])
        reach[m] = seen
    groups = {frozenset(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}
    found = []
    for group in groups:
        cycle = _cycle({m: graph[m] & group for m in group})
        assert cycle is not None  # every module of a group reaches every other
        found.append(cycle)
    return sorted(found)


def _is_package_init(a: str, b: str) -> bool:
    """``kvtier.x`` (its __init__ re-exports) and ``kvtier.x.y`` (which it imports): not a cycle."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_cycles():
    graph = _graph()
    for a in graph:  # a package's __init__ and its own submodules import each other by design
        graph[a] = {b for b in graph[a] if not _is_package_init(a, b)}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (type-only imports count):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_every_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b", "a"], ["d", "e", "d"]]


def test_the_import_reader_counts_type_only_and_function_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvtier.a import A\n"
        "def f():\n    import kvtier.b\n"
        "try:\n    import kvtier.c\nexcept ImportError:\n    from kvtier import d\n"
    )
    assert [m for m, _, _ in _imports(source)] == ["typing", "kvtier.a", "kvtier.b", "kvtier.c", "kvtier"]


def test_no_module_imports_another_modules_private_names():
    found = [
        f"{_module_name(path)}:{line}: from {module} import {n}"
        for path in MODULES.values()
        for module, names, line in _imports(path)
        if module.startswith("kvtier")
        for n in names
        if _is_private(n)
    ]
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------------------
# tests use kvtier's public surface


def _names_defined(paths: list[Path]) -> set[str]:
    """Every name the files define: functions, classes, assigned names (module globals, class
    fields) and attributes they set (``self._x = ...``)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def _test_names_defined(path: Path, members_only: bool = False) -> set[str]:
    """The names a test file defines for itself: as :func:`_names_defined`, but of attributes only
    those a class of the tests sets on itself (``self._x = ...``: ``engine._x = ...`` is a write
    into a kvtier object, not a definition). ``members_only``: only its classes' members (methods,
    fields, ``self._x``), what another file can reach through an object of the class."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(member.name)
                elif isinstance(member, ast.Assign | ast.AnnAssign):  # class fields
                    names.update(t.id for t in ast.walk(member) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store))
        if members_only:
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


PATCHERS = {"getattr", "setattr", "hasattr", "delattr"}  # builtins, and monkeypatch's setattr/delattr


def _reach_ins(source: str, kvtier_private: set[str], own: set[str]) -> list[tuple[int, str]]:
    """(line, code) of each place ``source`` (a test) touches a private name of kvtier's:
    imports it from a kvtier module, reads or writes ``x._y`` with ``_y`` in ``kvtier_private``
    and not in ``own`` (the tests' own names), or names it in a string to getattr/setattr/
    hasattr/delattr or monkeypatch (``"_y"``, ``"kvtier.m._y"``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvtier":
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if _is_private(a.name)]
        elif isinstance(node, ast.Attribute):
            if _is_private(node.attr) and node.attr in kvtier_private and node.attr not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if called not in PATCHERS:
                continue
            for arg in node.args[:2]:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    continue
                dotted = "." in arg.value
                name = arg.value.rsplit(".", 1)[-1]
                if dotted and arg.value.split(".")[0] == "kvtier" and _is_private(name):
                    found.append((node.lineno, ast.unparse(node)))
                elif not dotted and _is_private(name) and name in kvtier_private and name not in own:
                    found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_no_test_reaches_into_kvtiers_private_names():
    kvtier_private = {n for n in _names_defined(list(MODULES.values())) if _is_private(n)}
    # a test's own names: those its file defines, and the members of the classes of the helper
    # modules tests import (conftest.py, redis_servers.py, ...); a name that another test file
    # happens to define, or a helper module's function, is not a member of a kvtier object's
    shared = set().union(*(_test_names_defined(p, members_only=True) for p in TEST_FILES if not p.name.startswith("test_")))
    found = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in TEST_FILES
        for line, code in _reach_ins(path.read_text(), kvtier_private, shared | _test_names_defined(path))
    ]
    assert not found, f"{len(found)} reach-ins into kvtier's private names (use or add a public accessor):\n" + "\n".join(found)


def test_the_reach_in_finder_finds_each_kind():
    source = (
        "from kvtier.cache.tree import TreeManager, _Node\n"  # 1: a private import
        "mgr._evict_device(3)\n"  # 2: a private method
        "engine._loop = None\n"  # 3: a private attribute written
        "monkeypatch.setattr(FileBackend, '_write', w)\n"  # 4: patched by name
        "monkeypatch.setattr('kvtier.serve.router._load', f)\n"  # 5: patched by dotted path
        "getattr(pool, '_free')\n"  # 6: read by name
        "torch.cuda._sleep(10)\n"  # not kvtier's: no kvtier module defines _sleep
        "fake._state\n"  # the tests' own: a fake defines self._state
        "obj.__class__\n"  # a dunder
    )
    kvtier_private = {"_Node", "_evict_device", "_loop", "_write", "_load", "_free", "_state"}
    assert [line for line, _ in _reach_ins(source, kvtier_private, own={"_state"})] == [1, 2, 3, 4, 5, 6]
