"""A config file read key by key, every refusal naming the file, line and key.

`read_yaml` parses a file (within yamlfile's bounds) and maps each dotted key path to
the line it is written on; a `Reader` hands out the file's mappings and values through
the checks of `gateway.config.validate`, turning a check's ValueError into
`RulesError(file, line, key, reason)`. A key that is unknown where it stands is answered
with the mapping it belongs to, from the table of sections the reader is given.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from gateway.config.yamlfile import load_yaml
from gateway.errors import RulesError

Lines = dict[str, int]


def _line_map(root: yaml.Node) -> Lines:
    """Dotted key path -> 1-based line of its key, for error messages."""
    lines: Lines = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = f"{prefix}.{k.value}" if prefix else str(k.value)
                lines[path] = k.start_mark.line + 1
                walk(v, path)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                path = f"{prefix}[{i}]"
                lines[path] = item.start_mark.line + 1
                walk(item, path)

    walk(root, "")
    return lines


def _homes(sections: Mapping[str, frozenset[str]], key: str, here: str) -> str | None:
    """Where else `key` is allowed, as the error names it; None when nowhere."""
    found = sorted(s for s, keys in sections.items() if key in keys and s != here)
    if not found:
        return None
    if found == [""]:
        return "at the top level"
    names = [f"{s.replace('[]', '[i]')}:" if s else "the top level" for s in found]
    return "under " + (names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}")


class Reader:
    """Typed access to a parsed YAML mapping that reports file:line: key: reason.
    `sections`: every mapping of the file (dotted path, list items as []) and its keys."""

    def __init__(self, file: str, lines: Lines, sections: Mapping[str, frozenset[str]]) -> None:
        self.file, self.lines, self.sections = file, lines, sections

    def fail(self, key: str, reason: str) -> RulesError:
        line = self.lines.get(key)
        probe = key
        while line is None and ("." in probe or "[" in probe):
            probe = probe.rsplit(".", 1)[0] if "." in probe else probe.rsplit("[", 1)[0]
            line = self.lines.get(probe)
        return RulesError(self.file, line, key, reason)

    def section(self, data: Any, key: str, schema: str | None = None) -> dict[str, Any]:
        """The mapping at `key`, holding only keys its section allows (`schema`: the
        section's name in `sections` when `key` is spelled otherwise; list indices as [])."""
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise self.fail(key, f"must be a mapping, got {type(data).__name__}")
        here = re.sub(r"\[\d+\]", "[]", key) if schema is None else schema
        allowed = self.sections[here]
        unknown = [k for k in data if k not in allowed]
        if unknown:
            first = unknown[0]
            where = f"{key}.{first}" if key else str(first)
            home = _homes(self.sections, str(first), here)
            if home is None:
                raise self.fail(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")
            others = [(str(k), _homes(self.sections, str(k), here)) for k in unknown[1:]]
            same = [k for k, h in others if h == home]
            elsewhere = [f"{k} ({h})" for k, h in others if h is not None and h != home]
            reason = f"unknown key here; it belongs {home}"
            if same:
                reason += f" (as do {', '.join(same)})"
            if elsewhere:
                reason += f"; also misplaced here: {', '.join(elsewhere)}"
            raise self.fail(where, reason)
        return data

    def get(
        self,
        data: dict[str, Any],
        prefix: str,
        name: str,
        check: Callable[[Any], Any],
        default: Any,
    ) -> Any:
        if name not in data:
            return default
        key = f"{prefix}.{name}" if prefix else name
        try:
            return check(data[name])
        except ValueError as exc:
            raise self.fail(key, str(exc)) from None


def read_yaml(path: Path) -> tuple[Any, Lines]:
    """The file's data and the line of each of its keys."""
    data, root = load_yaml(path)
    return data, _line_map(root)
