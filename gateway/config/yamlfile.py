"""Config YAML read within bounds: file size, nesting depth, nodes after alias expansion.

PyYAML's composer turns an alias into a shared reference to the anchored node, so a
432-byte "billion laughs" file composes into a handful of nodes; it is whatever walks
them afterwards (construction, validation, the key -> line map) that meets 10**9.
Counting here, while composing, each node's size *as expanded* refuses such a file
after a few hundred nodes of work. Depth is bounded too (a 5,000-deep file would
otherwise blow Python's recursion limit in the walks), and an alias inside the node
it names (a cycle) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gateway.errors import RulesError

# PyYAML's pure-Python loader (needed for the hooks below) takes 1-5 s per MiB and
# ~50 us per node on a busy core: the bounds keep a worst-case file near a second, 40x
# and 50x over the shipped files (gateway.yaml: 6 KB, 187 nodes)
MAX_BYTES = 256 << 10
MAX_DEPTH = 64
MAX_NODES = 10_000
EMPTY = ("empty document: a config file must hold a mapping (write {} for all defaults; "
         "an empty file is refused so that a write caught halfway cannot reset the config)")


class _Refused(yaml.YAMLError):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.problem_mark = problem, mark


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that measures every node as it composes it: (expanded size, height)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._depth = 0
        self._measured: dict[int, tuple[int, int]] = {}  # id(node): nodes stay referenced

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        # refused while scanning: the scanner looks ~1,000 tokens ahead for a simple key,
        # each step quadratic in the flow depth (a 5,000-deep `[[[` costs a second)
        if self.flow_level >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def _next_event(self) -> Any:
        # types-PyYAML leaves Parser.peek_event unannotated (it returns an Event)
        return self.peek_event()  # type: ignore[no-untyped-call]

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self._next_event()
            target = self.anchors.get(event.anchor)
            if target is not None:  # an unknown anchor is PyYAML's own error
                measured = self._measured.get(id(target))
                if measured is None:
                    raise _Refused(f"alias *{event.anchor} is inside the node it names",
                                   event.start_mark)
                if self._depth + measured[1] > MAX_DEPTH:
                    raise _Refused(f"alias *{event.anchor} nests deeper than {MAX_DEPTH} "
                                   "levels", event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self._next_event().start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        if node is None:  # the stubs allow it; PyYAML's composer always returns a node
            return None
        if isinstance(node, yaml.MappingNode):  # a key twice: the parse keeps the last
            seen: set[str] = set()  # (a second `memory:` pasted below would drop the first)
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    if key.value in seen:
                        raise _Refused(f"key {key.value!r} appears twice in this mapping "
                                       "(the first would be silently dropped)",
                                       key.start_mark)
                    seen.add(key.value)
        size, height = self._measure(node)
        if size > MAX_NODES:
            raise _Refused(f"more than {MAX_NODES} nodes once aliases are expanded",
                           node.start_mark)
        self._measured[id(node)] = (size, height)
        return node

    def _measure(self, node: Any) -> tuple[int, int]:
        if isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            kids = node.value
        else:
            return 1, 1
        sizes = [self._measured[id(k)] for k in kids]
        return 1 + sum(s for s, _ in sizes), 1 + max((h for _, h in sizes), default=0)


def yaml_problem(exc: yaml.YAMLError) -> tuple[str | None, int | None]:
    """A YAML error's problem and its line (1-based); None where PyYAML names none."""
    mark = getattr(exc, "problem_mark", None)
    return getattr(exc, "problem", None), (mark.line + 1 if mark is not None else None)


def yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, what and where (line N), without PyYAML's excerpt."""
    problem, line = yaml_problem(exc)
    what = problem or type(exc).__name__
    return f"{what} (line {line})" if line is not None else what


def load_yaml(path: Path) -> tuple[Any, yaml.Node]:
    """The data of one YAML config file and its node tree (for line numbers), or a
    RulesError: unreadable, over MAX_BYTES, invalid, out of bounds, or empty."""
    file = str(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise RulesError(file, None, "<file>", f"cannot read: {exc}") from None
    if len(raw) > MAX_BYTES:
        raise RulesError(file, None, "<file>", f"file is over {MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RulesError(file, None, "<file>", f"cannot read: {exc}") from None
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        problem, line = yaml_problem(exc)
        problem = problem or str(exc)
        what = "refused" if isinstance(exc, _Refused) else "invalid YAML"
        raise RulesError(file, line, "<yaml>", f"{what}: {problem}") from None
    except (ValueError, OverflowError) as exc:  # e.g. a timestamp like 2024-13-45
        raise RulesError(file, None, "<yaml>", f"invalid YAML value: {exc}") from None
    finally:
        loader.dispose()
    if data is None or root is None:
        raise RulesError(file, None, "<document>", EMPTY)
    return data, root
