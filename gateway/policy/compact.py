"""Tool-result compaction: old, bulky tool results shrunk in place before turns are dropped.

Pure: a compacted text is a function of the result's text and the rules alone (no
session, no clock), so the same history compacts to the same bytes on every request
and replica and providers' prompt caches keep hitting. Lossless first (a JSON result
with its whitespace removed); past the target size, excerpts that keep what an agent
reads: head and tail lines and error lines of a text, the first and last elements of a
long JSON list, one element of each shape, error-looking ones, then distinct values (a
repeat adds nothing: the marker counts the omitted repeats of kept elements, and the
range of omitted numbers), heads and tails of long strings. Every omission is said in
the text ("[memgate: ...]") with its exact count, never silent, and a text that holds
that marker is left alone, so compacting twice changes nothing.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from gateway.config.schema import CompactRules

MARK = "[memgate: "
_SCALARS = frozenset({str, int, float, bool, type(None)})
_NUMBERS = frozenset({int, float})
_CUT_SLACK = 40  # an inline marker's length: a string this much over the limit stays whole
_WORDS = ("error", "warn", "fail", "exception", "traceback", "fatal", "denied", "not found")
_ERROR = re.compile("|".join(_WORDS), re.IGNORECASE)
# JSON whitespace outside strings (strings matched whole, so theirs stays)
_JSON_WS = re.compile(r'("(?:[^"\\]|\\.)*")|[ \t\n\r]+', re.DOTALL)
# of a JSON text: its keys (a string and a colon) and its numbers as spelled, in order
_JSON_KEYS_NUMBERS = re.compile(r'"(?:[^"\\]|\\.)*"(\s*:)?|(-?[0-9][0-9.eE+-]*)', re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolResult:
    """One tool result of a history: item `index`, the text at `path` inside it (keys
    and list indices from the item), the tool's name when its call says."""

    index: int
    path: tuple[str | int, ...]
    text: str
    tool: str | None


def archive_id(tenant: str, text: str) -> str:
    """The id the original of a compacted result is archived under: from its content
    (the same on every request and replica) and the tenant, whose store holds it (ids
    are unique across a store)."""
    digest = hashlib.sha256(tenant.encode() + b"\0" + text.encode("utf-8", "surrogatepass"))
    return "cmp-" + digest.hexdigest()[:32]


_MISS = object()
_MEMO: OrderedDict[tuple[str, CompactRules, str | None, str | None], str | None] = OrderedDict()
_MEMO_LIMIT = 8_000_000  # characters of the results whose compacted forms are remembered
_memo_chars = 0
_memo_lock = threading.Lock()


def compact_text(text: str, rules: CompactRules, archived_as: str | None = None,
                 tool: str | None = None) -> str | None:
    """The compacted form of a tool result's text, or None: left as it is (short,
    already compacted, or nothing to gain). `archived_as`: the id its original is
    archived under, said in the marker (None: not archived); with `tool` (memgate's
    retrieval tool) it is the handle that tool takes, and the marker says so.

    A function of its arguments, so it is remembered (least recently used first out,
    up to _MEMO_LIMIT characters of results): every request of a session resends the
    same old results, and only the new ones are compacted."""
    global _memo_chars
    if len(text) < rules.min_chars or MARK in text:
        return None
    key = (text, rules, archived_as, tool)
    with _memo_lock:
        hit = _MEMO.get(key, _MISS)
        if hit is not _MISS:
            _MEMO.move_to_end(key)
            return hit  # type: ignore[return-value]
    out = _compact_text(text, rules, archived_as, tool)
    if len(text) <= _MEMO_LIMIT // 4:
        with _memo_lock:
            if key not in _MEMO:
                _MEMO[key] = out
                _memo_chars += len(text)
                _trim_memo()
    return out


def bound_memo(max_bytes: int) -> None:
    """Remember results up to about `max_bytes` (limits.cache_mb): a result's text and
    its compacted form, which is shorter, so half as many characters of results."""
    global _MEMO_LIMIT
    with _memo_lock:
        _MEMO_LIMIT = max_bytes // 2
        _trim_memo()


def _trim_memo() -> None:
    global _memo_chars
    while _memo_chars > _MEMO_LIMIT:
        old, _ = _MEMO.popitem(last=False)
        _memo_chars -= len(old[0])


def _compact_text(text: str, rules: CompactRules, archived_as: str | None,
                  tool: str | None = None) -> str | None:
    value = _json(text)
    if value is not None:
        ws = sum(map(text.count, " \n\t\r"))  # minifying removes at most these
        if len(text) - ws <= rules.target_chars:
            minified = _JSON_WS.sub(lambda m: m.group(1) or "", text)
            if len(minified) <= rules.target_chars:
                return minified if minified != text else None
        if _written_back(text, value[0]):
            out = _Shrink(rules)
            body = orjson.dumps(out.value(value[0])).decode()
            what = out.said()
        else:  # written from its parse it would say other numbers or lose a key: a text
            body, what = _lines(text, rules)
    else:
        body, what = _lines(text, rules)
    if len(body) >= len(text):
        return None
    if tool and archived_as:
        where = f"full result: call {tool} with handle \"{archived_as}\""
    else:
        where = f"full result archived as {archived_as}" if archived_as else "not archived"
    return (f"{body}\n{MARK}compacted tool result, {len(text):,} characters: {what}; "
            f"{len(text) - len(body):,} characters omitted; {where}]")


def _json(text: str) -> tuple[Any] | None:
    """(the parse,) of a JSON object or array text, None otherwise."""
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        return None
    try:
        return (orjson.loads(text),)
    except orjson.JSONDecodeError:
        return None


def _written_back(text: str, value: Any) -> bool:
    """Does orjson write `value` (the parse of `text`) back with the same keys and every
    number the same number (1E5 may say 100000.0)? Not when a key repeats (the parse
    keeps the last one), nor for an integer past 64 bits (read as a float:
    12345678901234567890123 would say 1.2345678901234568e+22) or a decimal past a
    double's digits (0.1000000000000000055511151231257827 would say 0.1): an excerpt
    built from the parse would show the tool saying what it did not."""
    def said(s: str) -> list[str]:  # ":" for a key, a number as spelled
        return [n or ":" for m in _JSON_KEYS_NUMBERS.finditer(s)
                if (n := m.group(2)) or m.group(1) is not None]

    try:
        back, orig = said(orjson.dumps(value).decode()), said(text)
    except orjson.JSONEncodeError:
        return False
    if back == orig:
        return True
    try:
        return len(back) == len(orig) and all(
            a == b or (":" not in (a, b) and Decimal(a) == Decimal(b))
            for a, b in zip(back, orig))
    except InvalidOperation:
        return False


def _may_hold_error(text: str) -> bool:
    """Could _ERROR match somewhere in text? Exact for ASCII, by str's own search (the
    regex is slow over megabytes); True otherwise (the regex decides)."""
    if not text.isascii():
        return True
    low = text.lower()
    return any(w in low for w in _WORDS)


def _cut(s: str, limit: int) -> tuple[str, int]:
    """A string's head and tail around an inline marker, and how many characters went
    (none when the marker would take about as much as it saves)."""
    if len(s) <= limit + _CUT_SLACK:
        return s, 0
    head, tail = limit * 2 // 3, limit // 3
    gone = len(s) - head - tail
    return f"{s[:head]} {MARK}{gone:,} characters omitted] {s[len(s) - tail:]}", gone


def _lines(text: str, rules: CompactRules) -> tuple[str, str]:
    """Head, tail and error lines of a text, each run of omitted lines marked in place.
    Lines end at "\n" only: a kept line keeps its "\r", form feed or other separator."""
    lines = text.split("\n")
    if len(lines) > 1 and not lines[-1]:  # a final newline ends the last line
        lines.pop()
    n = len(lines)
    keep = set(range(min(n, rules.head_lines))) | set(range(max(0, n - rules.tail_lines), n))
    errors = [i for i in range(n) if i not in keep and _ERROR.search(lines[i])]
    keep.update(errors[: rules.error_lines])
    out: list[str] = []
    omitted = shortened = 0
    run = 0
    for i, line in enumerate(lines):
        if i not in keep:
            run += 1
            continue
        if run:
            out.append(f"{MARK}{run:,} lines omitted]")
            omitted += run
            run = 0
        kept, gone = _cut(line, rules.max_line)
        shortened += gone > 0
        out.append(kept)
    if run:
        out.append(f"{MARK}{run:,} lines omitted]")
        omitted += run
    what = f"{omitted:,} of {n:,} lines omitted"
    if shortened:
        what += f", {shortened:,} long lines shortened"
    return "\n".join(out), what


class _Shrink:
    """A JSON value with long lists, objects and strings excerpted, counting what went."""

    def __init__(self, rules: CompactRules) -> None:
        self.rules = rules
        self.items = self.members = self.strings = 0

    def value(self, v: Any) -> Any:
        if isinstance(v, str):
            r = self.rules
            if len(v) > r.max_line and v.count("\n") >= r.head_lines + r.tail_lines:
                self.strings += 1  # a text inside the JSON (a file, a diff): its lines
                return _lines(v, r)[0]
            s, gone = _cut(v, r.max_line)
            self.strings += gone > 0
            return s
        if isinstance(v, list):
            return self._list(v)
        if isinstance(v, dict):
            return self._object(v)
        return v

    def _list(self, v: list[Any]) -> list[Any]:
        n, limit = len(v), self.rules.max_items
        if n <= limit:
            return [self.value(x) for x in v]
        # what makes elements alike: an object's keys, else the type (mapped in C: a
        # list of thousands of numbers is common)
        types = list(map(type, v))
        kinds = set(types)
        shapes: list[Any] = ([tuple(x) if t is dict else t for x, t in zip(v, types)]
                             if dict in kinds else types)
        first = dict(zip(reversed(shapes), range(n - 1, -1, -1)))  # shape -> first index
        # what makes elements the same: their value (a scalar as it is, tagged with its
        # type so 1, 1.0 and True differ, unless the list has one type; anything else
        # as its JSON)
        if len(kinds) == 1 and types[0] in _SCALARS:
            same: list[Any] = v
        else:
            same = [(t, x) if t in _SCALARS else orjson.dumps(x) for x, t in zip(v, types)]
        # the first and last elements, the first of each other shape, error-looking ones
        # (looked for one by one only when the whole list has one: no pattern spans
        # two elements)
        keep = {0, n - 1, *sorted(first.values())[: limit - 2]}
        if (dict in kinds or str in kinds) and _may_hold_error(orjson.dumps(v).decode()):
            for i in range(n):
                if len(keep) >= limit:
                    break
                if i not in keep and types[i] in (dict, str) and _ERROR.search(
                        orjson.dumps(v[i]).decode()):
                    keep.add(i)
        # the rest of the room: the head's distinct values (a repeat says nothing new:
        # the markers count the repeats of kept elements)
        seen = {same[i] for i in keep}
        for i in range(n):
            if len(keep) >= limit:
                break
            if same[i] not in seen:
                keep.add(i)
                seen.add(same[i])
        out: list[Any] = []
        prev = -1
        for i in sorted(keep):
            if i > prev + 1:
                out.append(self._gap(v, types, shapes, same, first, seen, prev + 1, i))
            out.append(self.value(v[i]))
            prev = i
        return out

    def _gap(self, v: list[Any], types: list[type], shapes: list[Any], same: list[Any],
             first: dict[Any, int], seen: set[Any], a: int, b: int) -> str:
        """The marker for elements a..b-1 omitted: how many; how many of them repeat a
        kept element; their shared keys, or the range of omitted numbers."""
        self.items += b - a
        said = [f"{MARK}{b - a:,} elements omitted"]
        repeats = sum(map(seen.__contains__, same[a:b]))
        if repeats:
            said.append(f"{repeats:,} of them repeats of kept elements")
        alike = set(shapes[a:b])
        if len(alike) == 1 and type(shape := alike.pop()) is tuple:
            said.append(f"with the keys of element {first[shape]}")
        elif repeats < b - a and set(types[a:b]) <= _NUMBERS:
            said.append(f"numbers from {min(v[a:b])!r} to {max(v[a:b])!r}")
        return ", ".join(said) + "]"

    def _object(self, v: dict[str, Any]) -> dict[str, Any]:
        names = list(v)
        limit = self.rules.max_items
        if len(names) <= limit:
            return {k: self.value(x) for k, x in v.items()}
        gone = len(names) - limit
        self.members += gone
        out = {k: self.value(v[k]) for k in names[: limit - 1]}
        out["[memgate]"] = f"{MARK}{gone:,} members omitted]"
        out[names[-1]] = self.value(v[names[-1]])
        return out

    def said(self) -> str:
        parts = []
        if self.items:
            parts.append(f"{self.items:,} list elements omitted")
        if self.members:
            parts.append(f"{self.members:,} object members omitted")
        if self.strings:
            parts.append(f"{self.strings:,} long strings shortened")  # a count: no plural
        return ", ".join(parts) or "whitespace removed"


def eligible(results: Sequence[ToolResult], rules: CompactRules,
             protected: frozenset[int] = frozenset(), unread: int | None = None
             ) -> list[ToolResult]:
    """The results that may be compacted: all but the newest keep_recent and those from
    item `unread` on (after the last assistant item: the model has not read them yet,
    e.g. parallel calls' results), not the excluded tools' nor those of `protected`
    items (pins), at least min_chars long."""
    old = results[: max(0, len(results) - rules.keep_recent)]
    return [r for r in old
            if r.index not in protected and len(r.text) >= rules.min_chars
            and (unread is None or r.index < unread)
            and (r.tool is None or r.tool not in rules.exclude_tools)]


def with_text(item: Any, path: Sequence[str | int], text: str) -> Any:
    """A copy of `item` with the value at `path` replaced by `text` (copied along the
    path only: the item itself is the client's parse and stays as it came)."""
    if not path:
        return text
    head, rest = path[0], path[1:]
    if isinstance(item, dict):
        return {**item, head: with_text(item[head], rest, text)}
    out = list(item)
    out[head] = with_text(item[head], rest, text)  # type: ignore[index]
    return out
