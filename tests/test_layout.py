"""The gateway's modules import each other without cycles (imports read with ast).

A module-level cycle works until someone moves a line: the module imported second sees the
first half-initialised. An import deferred into a function to dodge a cycle is still one (the
two modules cannot be understood apart; STYLE.md's counter-example has 176 of them), so the
graph is checked twice: module level only, and with the imports in function bodies. Imports
under `if TYPE_CHECKING:` never run and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import gateway

PACKAGE_DIR = Path(gateway.__file__).resolve().parent


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Every module of the package under `root`: dotted name -> (file, is a package)."""
    found: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        found[".".join([package, *parts])] = (path, is_pkg)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], deferred: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (module level, class
    bodies, if/try/with/for blocks), and with `deferred` those in function bodies too;
    never those under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            out += _import_nodes(node.orelse, deferred)
        else:
            blocks = [getattr(node, f, []) for f in ("body", "orelse", "finalbody")]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            blocks += [c.body for c in getattr(node, "cases", [])]
            for block in blocks:
                if isinstance(block, list):
                    out += _import_nodes([s for s in block if isinstance(s, ast.stmt)],
                                         deferred)
    return out


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool,
             known: dict[str, tuple[Path, bool]]) -> set[str]:
    """The package's modules one import statement of module `name` loads."""
    if isinstance(node, ast.Import):
        wanted = {alias.name for alias in node.names}
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if is_pkg else name.split(".")[:-1]
            anchor = here[: len(here) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        # `from pkg import x` loads pkg, and pkg.x too when x is a module
        wanted = {base} | {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
    loaded: set[str] = set()
    for target in wanted:
        # importing a.b.c runs a and a.b first; those that contain `name` are already running
        chain = [*_ancestors(target), target]
        loaded |= {m for m in chain if m in known and m not in _ancestors(name)}
    loaded.discard(name)
    return loaded


def import_graph(root: Path, package: str, deferred: bool = False) -> dict[str, set[str]]:
    """module -> the package's modules it imports at import time (and with `deferred`, in
    its functions)."""
    known = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = set()
        for node in _import_nodes(tree.body, deferred):
            graph[name] |= _targets(node, name, is_pkg, known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_gateway_has_no_import_cycles() -> None:
    """No two gateway modules import each other at import time, directly or through others."""
    graph = import_graph(PACKAGE_DIR, "gateway")
    assert "gateway.proxy.appstate" in graph["gateway.proxy.handlers"]  # the graph sees imports
    assert cycles(graph) == []


def test_gateway_has_no_cycles_through_deferred_imports() -> None:
    """Nor through an import deferred into a function (app used to import handlers in
    create_app while handlers imported app for GatewayState; cli and demo the same)."""
    graph = import_graph(PACKAGE_DIR, "gateway", deferred=True)
    assert "gateway.cli.demo" in graph["gateway.cli.main"]  # the graph sees deferred imports
    assert cycles(graph) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


def test_finder_reports_a_cycle_through_a_subpackage(tmp_path: Path) -> None:
    """A cycle a -> sub.b -> c -> a is found; one through a function body only when deferred
    imports count; one through TYPE_CHECKING never."""
    _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from .sub.b import B\n",
        "sub/__init__.py": "",
        "sub/b.py": "from .. import c\nB = 1\n",
        "c.py": "import pkg.a\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\n",
        "e.py": "def late():\n    from .d import x\n",
        "f.py": "class F:\n    def run(self):\n        from .h import H\n",
        "h.py": "try:\n    from .f import F\nexcept ImportError:\n    F = None\n",
    })
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycles(import_graph(tmp_path, "pkg", deferred=True)) == [
        ["pkg.a", "pkg.c", "pkg.sub.b"], ["pkg.f", "pkg.h"]]


def test_finder_treats_a_package_init_as_imported_first(tmp_path: Path) -> None:
    """Importing sub.x runs sub/__init__ first: sub/__init__ -> y -> sub.x is a cycle, while
    sub.x reaching its own package's __init__ is not."""
    _write(tmp_path, {
        "__init__.py": "",
        "y.py": "from .sub.x import X\n",
        "sub/__init__.py": "from ..y import X\n",
        "sub/x.py": "from . import z\nX = 1\n",
        "sub/z.py": "",
    })
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.sub", "pkg.y"]]
