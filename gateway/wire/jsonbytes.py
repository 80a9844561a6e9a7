"""Byte spans of the values of a valid JSON text, and edits made on those bytes.

A body the gateway rewrites is the client's bytes with spans cut out and the
gateway's own bytes put in, never a re-serialisation: that would turn integers
past 64 bits into floats and change escapes, key order, whitespace and duplicate
keys, and orjson writes only 254 levels of the 1024 it reads.

The scanner trusts that the text is valid JSON (orjson has parsed it) and only
finds where each value ends. Its fast path: a value whose orjson serialisation
is found at its position ends there, because objects, arrays and strings are
prefix-free; that is what compact writers send (the openai and anthropic SDKs,
JSON.stringify, orjson), a whole list of them checked with one comparison. Any
other spelling is matched by a regex that knows nesting up to a fixed depth
(in C), and what is nested deeper is walked string by string, bracket by bracket.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise, repeat
from operator import add
from typing import Any

import orjson

_NEXT = re.compile(rb'["\[\]{}]')  # a string or a bracket: what nesting depends on
_WS = re.compile(rb"[ \t\n\r]*")
_SCALAR = re.compile(rb"[^,\]} \t\n\r]+")
_PREFIX_FREE = (dict, list, str)  # a number's serialisation may be a prefix of another's
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_PLAIN = rb'[^"\[\]{}]++'  # no string, no bracket


def _nested(depth: int) -> re.Pattern[bytes]:
    """An object or array nested at most `depth` deep, matched whole by the regex engine
    (in C, some 3x faster than walking it here); possessive, so a deeper one fails fast."""
    inside = rb"(?:" + _PLAIN + rb"|" + _STRING + rb")*+"
    for _ in range(depth):
        container = rb"[\[{]" + inside + rb"[\]}]"
        inside = rb"(?:" + _PLAIN + rb"|" + _STRING + rb"|" + container + rb")*+"
    return re.compile(container)


_CONTAINER = _nested(8)

Span = tuple[int, int]
Edit = tuple[int, int, bytes]  # b[start:end] becomes these bytes


@dataclass(frozen=True, slots=True)
class Member:
    """One `"name": value` of an object: where its key starts, its value starts and ends."""

    name: str
    start: int
    value: int
    end: int
    items: list[Span] | None = None  # the spans of its elements: the array asked for


def string_end(b: bytes, i: int) -> int:
    """b[i] is an opening quote: the index after the closing one."""
    j = i + 1
    while True:
        j = b.index(b'"', j)
        k = j - 1
        while b[k] == 0x5C:  # backslashes before the quote: an odd run escapes it
            k -= 1
        if (j - 1 - k) % 2 == 0:
            return j + 1
        j += 1


def value_end(b: bytes, i: int) -> int:
    """The index after the JSON value starting at b[i]."""
    c = b[i]
    if c == 0x22:
        return string_end(b, i)
    if c in (0x7B, 0x5B):
        whole = _CONTAINER.match(b, i)
        if whole is not None:
            return whole.end()
        depth, j = 0, i  # nested deeper than the pattern
        while True:
            m = _NEXT.search(b, j)
            if m is None:
                raise ValueError("unterminated value")
            p = m.start()
            c = b[p]
            if c == 0x22:
                j = string_end(b, p)
                continue
            depth += 1 if c in (0x7B, 0x5B) else -1
            j = p + 1
            if depth == 0:
                return j
    m = _SCALAR.match(b, i)
    if m is None:
        raise ValueError("no value")
    return m.end()


def ws(b: bytes, i: int) -> int:
    """The index of the first non-whitespace byte from i on."""
    return _WS.match(b, i).end()  # type: ignore[union-attr]


def skip_items(b: bytes, off: int, n: int) -> int | None:
    """From the start of an item of a list, the start of the item `n` further on
    (None if the list ends first)."""
    for _ in range(n):
        off = ws(b, value_end(b, off))
        if b[off] != 0x2C:  # ',' - anything else: the list ended
            return None
        off = ws(b, off + 1)
    return None if b[off] == 0x5D else off


def _dumped(value: Any) -> bytes | None:
    """orjson's spelling of a prefix-free value (None: a number, or nested too deep)."""
    if type(value) not in _PREFIX_FREE:
        return None
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return None


def _end(b: bytes, i: int, spelled: bytes | None) -> int:
    if spelled is not None and b.startswith(spelled, i):
        return i + len(spelled)
    return value_end(b, i)


def members(b: bytes, i: int, values: dict[str, Any] | None = None,
            listed: str | None = None) -> list[Member]:
    """The members of the object at b[i], in order, duplicate keys included; `values`
    (its parse) lets a compactly written value be passed over in one comparison; an
    array under the name `listed` gets its elements' spans."""
    if b[i] != 0x7B:
        raise ValueError("not an object")
    out: list[Member] = []
    j = ws(b, i + 1)
    if b[j] == 0x7D:
        return out
    while True:
        if b[j] != 0x22:
            raise ValueError("no key")
        k = string_end(b, j)
        key = b[j + 1 : k - 1]
        name = orjson.loads(b[j:k]) if 0x5C in key else key.decode()
        c = ws(b, k)
        if b[c] != 0x3A:
            raise ValueError("no colon")
        v = ws(b, c + 1)
        value = values.get(name) if values is not None else None
        spans = None
        if name == listed and b[v] == 0x5B:
            spans = elements(b, v, value if type(value) is list else None)
            e = ws(b, spans[-1][1] if spans else v + 1) + 1  # after the ']'
        else:
            e = _end(b, v, _dumped(value) if values is not None else None)
        out.append(Member(name, j, v, e, spans))
        j = ws(b, e)
        if b[j] == 0x7D:
            return out
        if b[j] != 0x2C:
            raise ValueError("no comma")
        j = ws(b, j + 1)


def elements(b: bytes, i: int, values: Sequence[Any] | None = None) -> list[Span]:
    """The spans of the elements of the array at b[i]; `values` (its parse) as for
    `members`: a list written compactly as a whole is found by one comparison, and
    otherwise each element that is."""
    if b[i] != 0x5B:
        raise ValueError("not an array")
    j = ws(b, i + 1)
    if b[j] == 0x5D:
        return []
    return spans_from(b, j, values)


def spans_from(b: bytes, j: int, values: Sequence[Any] | None = None) -> list[Span]:
    """The spans of the elements of an array from the one starting at b[j] to the array's
    end (`values`: the parse of those elements, as for `elements`)."""
    spelled: Sequence[bytes | None] = ()
    if values is not None:
        try:
            whole = list(map(orjson.dumps, values))
        except orjson.JSONEncodeError:  # one is nested too deep: each on its own
            spelled = list(map(_dumped, values))
        else:
            joined = b",".join(whole)  # then a ']': the last one's end, a number's too
            if b.startswith(joined, j) and b[ws(b, j + len(joined))] == 0x5D:
                lens = list(map(len, whole))
                starts = list(accumulate(map(add, lens, repeat(1)), initial=j))
                return list(zip(starts, map(add, starts, lens)))
            spelled = [s if type(v) in _PREFIX_FREE else None for s, v in zip(whole, values)]
    out: list[Span] = []
    while True:
        e = _end(b, j, spelled[len(out)] if len(out) < len(spelled) else None)
        out.append((j, e))
        j = ws(b, e)
        if b[j] == 0x5D:
            return out
        if b[j] != 0x2C:
            raise ValueError("no comma")
        j = ws(b, j + 1)


def value_span(b: bytes, i: int, value: Any, path: Sequence[str | int]) -> Span:
    """The span of the value at `path` (object keys, list indices) inside the value at
    b[i] (parsed: `value`); a repeated key is the last one, the one a parser reads."""
    end = value_end(b, i) if not path else i
    for step in path:
        if isinstance(step, str):
            m = [m for m in members(b, i, value) if m.name == step][-1]
            i, end = m.value, m.end
        else:
            i, end = elements(b, i, value)[step]
        value = value[step]
    return i, end


def cut(spans: Sequence[Span], kept: Sequence[int]) -> list[Edit]:
    """The edits that leave only entries `kept` (ascending) of a container whose
    entries (elements, or members from key to value) are at `spans`, its commas valid:
    a gap after a kept entry goes with the comma before it, a leading gap with the
    comma after it. The bytes around and between kept entries stay."""
    n = len(spans)
    if not kept:
        return [(spans[0][0], spans[-1][1], b"")] if n else []
    edits: list[Edit] = []
    if kept[0] > 0:
        edits.append((spans[0][0], spans[kept[0]][0], b""))
    for a, z in pairwise(kept):
        if z > a + 1:
            edits.append((spans[a][1], spans[z - 1][1], b""))
    if kept[-1] < n - 1:
        edits.append((spans[kept[-1]][1], spans[-1][1], b""))
    return edits


def apply(b: bytes, edits: list[Edit]) -> bytes:
    """b with each edit made; edits must not overlap (ValueError)."""
    out: list[bytes | memoryview] = []
    view = memoryview(b)
    pos = 0
    for start, end, new in sorted(edits, key=lambda e: (e[0], e[1])):
        if start < pos:
            raise ValueError("overlapping edits")
        out.append(view[pos:start])
        out.append(new)
        pos = end
    out.append(view[pos:])
    return b"".join(out)


def append_edit(raw: bytes, payload: dict[str, Any], name: str, value: bytes,
                spans: Sequence[Span] | None = None) -> Edit:
    """The edit of the object `raw` (parsed: `payload`) that appends `value` to its
    top-level list `name` (or adds that list, holding it, first). `spans`: where the
    elements of another top-level list are, when known (the history): the top level is
    then read without scanning it. Raises ValueError when the bytes cannot be read so."""
    start = ws(raw, 0)
    if name not in payload:
        return (start + 1, start + 1, b'"' + name.encode() + b'":[' + value + b"],")
    v, spelled = -1, _dumped(payload[name])
    if spans:  # the history list replaced by [] while the top level is read
        at = raw.rfind(b"[", 0, spans[0][0])
        end = raw.index(b"]", spans[-1][1]) + 1
        view = raw[:at] + b"[]" + raw[end:]
        values = {k: x for k, x in payload.items() if k == name or type(x) is not list}
        found = [m.value for m in members(view, ws(view, 0), values) if m.name == name]
        if found:
            v = found[-1] + (end - at - 2 if found[-1] > at else 0)
    else:
        v = _last_member(raw, name, spelled)
    if v < 0:  # the whole top level read (the one orjson read: the last)
        found = [m.value for m in members(raw, start, payload) if m.name == name]
        v = found[-1] if found else -1
    if v >= 0 and payload[name] is None and raw.startswith(b"null", v):
        return (v, v + 4, b"[" + value + b"]")  # "tools": null, as some SDKs send unset
    if v < 0 or raw[v] != 0x5B:
        raise ValueError(f"{name} is not a list")
    close = _end(raw, v, spelled) - 1
    empty = raw[ws(raw, v + 1)] == 0x5D
    return (close, close, value if empty else b"," + value)


def _last_member(raw: bytes, name: str, spelled: bytes | None) -> int:
    """Where the value of the top-level member `name` starts, when it is the last such
    quoted text in `raw` (found from the end: clients put tools after the messages)
    and only top-level members follow it to the object's end; -1 otherwise. `spelled`:
    its value as orjson writes it (_dumped: a compactly written one is passed over in
    one comparison)."""
    key = b'"' + name.encode() + b'"'
    k = raw.rfind(key)
    if k < 0:
        return -1
    colon = ws(raw, k + len(key))
    if raw[colon] != 0x3A:
        return -1
    v = ws(raw, colon + 1)
    try:
        j = ws(raw, _end(raw, v, spelled))
        while raw[j] == 0x2C:  # the members after it: "key": value, each at the top
            j = ws(raw, j + 1)
            if raw[j] != 0x22:
                return -1
            j = ws(raw, string_end(raw, j))
            if raw[j] != 0x3A:
                return -1
            j = ws(raw, value_end(raw, ws(raw, j + 1)))
    except (IndexError, ValueError):
        return -1
    return v if raw[j] == 0x7D and ws(raw, j + 1) == len(raw) else -1
