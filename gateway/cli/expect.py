"""`memgate replay expect`: per-turn replay of a session against expectations.

Reset, append the session turn by turn, take the snapshot after each turn and
compare `must_contain` (dotted key -> wanted value) and `must_not_contain`.
`--self-check` runs again with each expectation deliberately corrupted and
fails if a corrupted run still passes: the harness must be able to fail.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway.config.carry import CarryPatterns
from gateway.config.schema import CarryRules
from gateway.config.yamlfile import yaml_error_line
from gateway.policy.carry import Message, ToolCall, build_snapshot

Expectations = dict[int, dict[str, Any]]


def load_session(path: Path) -> list[Message]:
    """One message a line: turn, role, text, and an assistant's tool calls (optional
    `calls`: [{name, arguments}], the arguments an object or its JSON text)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        rec = orjson.loads(line)
        if not isinstance(rec, dict) or not {"turn", "role", "text"} <= set(rec):
            raise ValueError(f"{path}:{n}: each line needs turn, role and text")
        calls = rec.get("calls") or []
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            raise ValueError(f"{path}:{n}: calls must be a list of {{name, arguments}}")
        out.append(Message(int(rec["turn"]), str(rec["role"]), str(rec["text"]),
                           tuple(map(_call, calls))))
    return out


def _call(c: dict[str, Any]) -> ToolCall:
    args = c.get("arguments", {})
    return ToolCall(c["name"], args if isinstance(args, str) else orjson.dumps(args).decode())


def load_expectations(path: Path) -> Expectations:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {yaml_error_line(exc)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of turn -> expectations")
    return {int(k): v or {} for k, v in data.items()}


def run(
    session: list[Message], expectations: Expectations, patterns: CarryPatterns,
    rules: CarryRules,
) -> list[str]:
    """One line per check: `turn N key OK` or `turn N key FAIL got=... want=...`."""
    lines: list[str] = []
    seen: list[Message] = []
    for i, m in enumerate(session):
        seen.append(m)
        last_of_turn = i + 1 == len(session) or session[i + 1].turn != m.turn
        if not last_of_turn:
            continue
        exp = expectations.get(m.turn, {})
        snap = build_snapshot(seen, patterns, rules)
        for key, want in (exp.get("must_contain") or {}).items():
            got = snap.get(key)
            status = "OK" if got == want else f"FAIL got={got!r} want={want!r}"
            lines.append(f"turn {m.turn} {key} {status}")
        for key in exp.get("must_not_contain") or []:
            status = "OK" if key not in snap else f"FAIL still kept: {snap.get(key)!r}"
            lines.append(f"turn {m.turn} {key} {status}")
    return lines


def corruptions(expectations: Expectations) -> list[tuple[str, Expectations]]:
    """Every expectation turned wrong, one at a time."""
    out = []
    for turn, exp in expectations.items():
        for key in exp.get("must_contain") or {}:
            bad = copy.deepcopy(expectations)
            bad[turn]["must_contain"][key] = "__corrupted__"
            out.append((f"turn {turn} {key}", bad))
        for j, key in enumerate(exp.get("must_not_contain") or []):
            bad = copy.deepcopy(expectations)
            bad[turn]["must_not_contain"].pop(j)
            bad[turn].setdefault("must_contain", {})[key] = "__corrupted__"
            out.append((f"turn {turn} not {key}", bad))
    return out
