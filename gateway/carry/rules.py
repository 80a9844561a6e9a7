"""Load rules/carry.yaml: ref patterns, deictics, task-state cues, the note template."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from re import _constants, _parser  # type: ignore[attr-defined]
from typing import Any

import yaml

from ..errors import RulesError

PICKS = ("latest", "earlier", "later")
_LITERAL = _constants.LITERAL
_BRANCH = _constants.BRANCH


@dataclass(frozen=True, slots=True)
class Deictic:
    pattern: re.Pattern[str]
    type: str  # a ref type, or "any"
    pick: str  # latest | earlier | later


@dataclass(frozen=True, slots=True)
class CarryPatterns:
    refs: tuple[tuple[str, re.Pattern[str]], ...]
    deictics: tuple[Deictic, ...]
    create: re.Pattern[str]
    ask: re.Pattern[str]
    close: re.Pattern[str]
    small_talk: re.Pattern[str]
    output_verbs: re.Pattern[str]
    note: str


def _literal_piece(op: Any, av: Any) -> tuple[str, int] | None:
    """(regex source, shortest length) of a node that matches only fixed strings: a
    literal character, or an alternation whose branches are all literal strings."""
    if op is _LITERAL:
        return re.escape(chr(av)), 1
    if op is _BRANCH:
        alts = []
        for branch in av[1]:
            if not branch or any(o is not _LITERAL for o, _ in branch):
                return None
            alts.append("".join(chr(a) for _, a in branch))
        return "(?:" + "|".join(map(re.escape, alts)) + ")", min(map(len, alts))
    return None


@functools.lru_cache(maxsize=512)
def required(pattern: re.Pattern[str]) -> re.Pattern[str] | None:
    """A cheap pattern that every match of `pattern` contains, or None.

    The longest run of consecutive top-level fixed-string nodes (literal characters,
    alternations of literal strings), compiled with the same flags: same case folding,
    so if it finds nothing in a text, `pattern` cannot match there either. Most
    messages lack the rare part of most ref patterns ("/", "服务", "-service"), and one
    fast scan for it replaces a slow scan with backtracking.
    """
    try:
        tree = _parser.parse(pattern.pattern, pattern.flags)
    except Exception:  # noqa: BLE001 - a prefilter is optional, the pattern still works
        return None
    best: tuple[list[str], int] = ([], 0)
    run: list[str] = []
    size = 0
    for op, av in tree:
        piece = _literal_piece(op, av)
        if piece is None:
            if size > best[1]:
                best = (run, size)
            run, size = [], 0
            continue
        run.append(piece[0])
        size += piece[1]
    if size > best[1]:
        best = (run, size)
    if not best[1] or (len(tree) == len(best[0])):  # nothing fixed, or the pattern itself
        return None
    return re.compile("".join(best[0]), pattern.flags)


def may_match(pattern: re.Pattern[str], text: str) -> bool:
    """False only when `pattern` certainly has no match in `text`."""
    need = required(pattern)
    return need is None or need.search(text) is not None


def _compile(file: str, key: str, pattern: Any) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise RulesError(file, None, key, "must be a non-empty regular expression")
    try:
        return re.compile(pattern, re.IGNORECASE | re.MULTILINE)
    except re.error as exc:
        raise RulesError(file, None, key, f"invalid regular expression: {exc}") from None


def load_carry_patterns(path: Path) -> CarryPatterns:
    file = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise RulesError(file, None, "<file>", f"cannot load: {exc}") from None
    if not isinstance(data, dict):
        raise RulesError(file, None, "<file>", "must be a mapping")
    unknown = set(data) - {"refs", "deictics", "task_state", "small_talk", "output_verbs", "note"}
    if unknown:
        raise RulesError(file, None, sorted(unknown)[0], "unknown key")
    refs = []
    for rtype, patterns in (data.get("refs") or {}).items():
        for i, p in enumerate(patterns if isinstance(patterns, list) else [patterns]):
            refs.append((str(rtype), _compile(file, f"refs.{rtype}[{i}]", p)))
    types = {t for t, _ in refs}
    deictics = []
    for i, d in enumerate(data.get("deictics") or []):
        key = f"deictics[{i}]"
        if not isinstance(d, dict):
            raise RulesError(file, None, key, "must be {pattern, type, pick}")
        dtype, pick = d.get("type", "any"), d.get("pick", "latest")
        if dtype != "any" and dtype not in types:
            raise RulesError(file, None, f"{key}.type", f"unknown ref type {dtype!r}")
        if pick not in PICKS:
            raise RulesError(file, None, f"{key}.pick", f"must be one of {', '.join(PICKS)}")
        deictics.append(Deictic(_compile(file, f"{key}.pattern", d.get("pattern")), dtype, pick))
    ts = data.get("task_state") or {}
    note = data.get("note")
    if not isinstance(note, str) or "{lines}" not in note:
        raise RulesError(file, None, "note", "must be a template containing {lines}")
    return CarryPatterns(
        refs=tuple(refs),
        deictics=tuple(deictics),
        create=_compile(file, "task_state.create", ts.get("create")),
        ask=_compile(file, "task_state.ask", ts.get("ask")),
        close=_compile(file, "task_state.close", ts.get("close")),
        small_talk=_compile(file, "small_talk", data.get("small_talk")),
        output_verbs=_compile(file, "output_verbs", data.get("output_verbs")),
        note=note,
    )
