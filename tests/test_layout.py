"""The package's shape: rooms in one import order, no import cycles, small modules.

`gateway/` is split into rooms (subpackages) whose order is the import order: a module
imports its own room and the rooms below it, never one above (ROOMS, top first; see
docs/architecture.md). A module-level cycle works until someone moves a line: the module
imported second sees the first half-initialised. An import deferred into a function to dodge
a cycle is still one (the two modules cannot be understood apart; the counter-example in the
shared STYLE.md has 176 of them), and so is one under `if TYPE_CHECKING:` (it never runs, but
the two modules still cannot be read apart), so the graph is checked with each kind of import.
Imports read with ast; nothing of the package is run."""

from __future__ import annotations

import ast
import re
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


def _import_nodes(body: list[ast.stmt], deferred: bool, typing_only: bool = False
                  ) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (module level, class
    bodies, if/try/with/for blocks), with `deferred` those in function bodies too, and with
    `typing_only` those under `if TYPE_CHECKING:`."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not deferred:
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not typing_only:
            out += _import_nodes(node.orelse, deferred)
        else:
            blocks = [getattr(node, f, []) for f in ("body", "orelse", "finalbody")]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            blocks += [c.body for c in getattr(node, "cases", [])]
            for block in blocks:
                if isinstance(block, list):
                    out += _import_nodes([s for s in block if isinstance(s, ast.stmt)],
                                         deferred, typing_only)
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


def import_graph(root: Path, package: str, deferred: bool = False, typing_only: bool = False
                 ) -> dict[str, set[str]]:
    """module -> the package's modules it imports at import time (and with `deferred`, in
    its functions; with `typing_only`, under `if TYPE_CHECKING:`)."""
    known = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = set()
        for node in _import_nodes(tree.body, deferred, typing_only):
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
    assert "gateway.proxy.appstate" in graph["gateway.proxy.app"]  # the graph sees imports
    assert cycles(graph) == []


def test_gateway_has_no_cycles_through_deferred_imports() -> None:
    """Nor through an import deferred into a function (app used to import handlers in
    create_app while handlers imported app for GatewayState; cli and demo the same)."""
    graph = import_graph(PACKAGE_DIR, "gateway", deferred=True)
    assert "gateway.observe.otel" in graph["gateway.proxy.app"]  # the graph sees deferred ones
    assert cycles(graph) == []


def test_gateway_has_no_cycles_through_type_checking_imports() -> None:
    """Nor through an import only type checkers read (console, its view and the gateway's
    state used to name each other's classes that way; so did the config and its printout)."""
    graph = import_graph(PACKAGE_DIR, "gateway", deferred=True, typing_only=True)
    assert "gateway.memory.backends" in graph["gateway.observe.metrics"]  # sees TYPE_CHECKING
    assert cycles(graph) == []


# the rooms of gateway/, top first: a module imports its own room and those below it
ROOMS = ("cli", "proxy", "observe", "memory", "decide", "wire", "policy", "measure", "config",
         "errors")
# the package itself (its public surface re-exports from the rooms) and the `python -m`
# entry stand above every room
ABOVE_ROOMS = frozenset({"__init__", "__main__"})
MAX_ROOT_MODULES = 8
MAX_LINES = 600
LONG_BECAUSE = "Why it is long:"  # a module over MAX_LINES says why in its docstring


def room_of(module: str, package: str = "gateway") -> str:
    """The room of a dotted module name: its first part under the package."""
    rest = module[len(package) + 1:] if module != package else "__init__"
    return rest.split(".")[0]


def upward_imports(graph: dict[str, set[str]], rooms: tuple[str, ...], package: str
                   ) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a room imports one above it in `rooms`."""
    rank = {r: i for i, r in enumerate(rooms)}
    out = []
    for module, targets in sorted(graph.items()):
        here = room_of(module, package)
        if here in ABOVE_ROOMS:
            continue
        assert here in rank, f"{module} is in no room: add its room to ROOMS"
        for target in sorted(targets):
            there = room_of(target, package)
            assert there in rank or there in ABOVE_ROOMS, f"{target} is in no room"
            if there in ABOVE_ROOMS or rank[there] < rank[here]:
                out.append((module, target))
    return out


def test_rooms_import_only_downward() -> None:
    """No module imports a room above its own, by any kind of import (module level, in a
    function, or for type checkers only)."""
    graph = import_graph(PACKAGE_DIR, "gateway", deferred=True, typing_only=True)
    assert upward_imports(graph, ROOMS, "gateway") == []


def test_package_root_is_small_and_modules_are_readable() -> None:
    """At most MAX_ROOT_MODULES modules at the root of gateway/; no module over MAX_LINES
    lines unless its docstring says why."""
    root = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    long = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > MAX_LINES and LONG_BECAUSE not in doc:
            long.append(f"{path.relative_to(PACKAGE_DIR)}: {text.count(chr(10))} lines")
    assert long == []


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


def test_order_check_reports_an_upward_import_of_any_kind(tmp_path: Path) -> None:
    """A lower room importing a higher one is reported, whether at module level, in a
    function or under TYPE_CHECKING; a downward import and the package's own surface are
    not."""
    _write(tmp_path, {
        "__init__.py": "from .top.a import A\n",
        "top/__init__.py": "",
        "top/a.py": "from ..low.b import B\nA = 1\n",
        "low/__init__.py": "",
        "low/b.py": "B = 1\ndef f():\n    from ..top import a\n",
        "low/c.py": ("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from ..top.a import A\n"),
    })
    graph = import_graph(tmp_path, "pkg", deferred=True, typing_only=True)
    assert upward_imports(graph, ("top", "low"), "pkg") == [
        ("pkg.low.b", "pkg.top"), ("pkg.low.b", "pkg.top.a"), ("pkg.low.c", "pkg.top"),
        ("pkg.low.c", "pkg.top.a")]
    assert upward_imports(import_graph(tmp_path, "pkg"), ("top", "low"), "pkg") == []


def test_architecture_page_lists_each_rooms_modules() -> None:
    """docs/architecture.md names every module of every room, and no module that is gone:
    its `Modules (`ls gateway/<room>/` ...)` paragraphs against the files."""
    page = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    paragraphs = re.findall(r"Modules \(`ls gateway/(\w+)/` at writing time\):(.*?)(?:\n\n|$)",
                            page, re.DOTALL)
    assert {room for room, _ in paragraphs} == set(ROOMS) - {"errors"}
    for room, text in paragraphs:
        listed = set(re.findall(r"`([\w/]+?\.py)`", text))
        wanted = {p.name for p in (PACKAGE_DIR / room).glob("*.py") if p.name != "__init__.py"}
        for sub in (PACKAGE_DIR / room).iterdir():
            if sub.is_dir() and (sub / "__init__.py").exists():
                wanted |= {p.name for p in sub.glob("*.py") if p.name != "__init__.py"}
        assert listed == wanted, (room, sorted(listed ^ wanted))
