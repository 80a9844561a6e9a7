"""Read a resent history without parsing again what the session already sent.

A client resends the whole body on every request: the same bytes up to some
message, then what is new. After a request, the byte offset where its last item
starts is located and kept with the bytes before it: for compact JSON as orjson
writes it, the last item's own bytes found from the end and verified by parsing
from there; otherwise a small scanner over the (valid) body; and when the request
itself was spliced, only its new items are scanned.
The next body that starts with exactly those bytes is parsed as

    {"<items key>":[ + <the rest of the body>

which is valid JSON exactly when the whole body is (the rest starts at an item
and ends the top-level object), and its items are the previous items before the
offset plus the ones parsed here. Whatever this cannot vouch for — a duplicate
or escaped key in the new part, keys repeated around the list, no new item —
falls back to parsing the whole body: a splice only ever saves work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway.wire.jsonbytes import Span, members, skip_items, spans_from, string_end, value_end, ws

_ASCII_ESCAPE = re.compile(rb"\\u00[2-7]")  # \u00XX spelling a printable ASCII character


# What a body must hold for the gateway to possibly change it with eviction off: its
# metadata key, or a \u00XX escape (it could spell that key).
MARKERS = (b"memgate", b"\\u00")
_OVERLAP = max(map(len, MARKERS)) - 1


def unmarked(b: bytes, start: int = 0, end: int | None = None) -> bool:
    """No MARKERS in b[start:end] (read in place, not copied)."""
    end = len(b) if end is None else end
    return all(b.find(m, start, end) < 0 for m in MARKERS)


@dataclass(frozen=True, slots=True)
class Splice:
    """Where a body's reusable part ends: `prefix` = body[:off], `count` items before it."""

    prefix: bytes
    count: int
    before: tuple[str, ...]  # top-level keys before the items list, in order
    key: str  # the items key ("messages", "input")
    unmarked: bool | None = None  # the prefix holds none of MARKERS (None: not searched)
    # where each of the `count` items before the offset starts and ends (None: not kept):
    # the same in every body that starts with `prefix`, so a body cut from the next one
    # scans only its new items for theirs
    spans: tuple[Span, ...] | None = None


def unmarked_from(b: bytes, rec: Splice) -> int:
    """Where in `b` a search for MARKERS has to start: after the prefix of `rec` (less
    what a marker straddling its end could take) if b starts with it and it holds none,
    else 0."""
    if rec.unmarked is not True or not b.startswith(rec.prefix):
        return 0
    return max(0, len(rec.prefix) - _OVERLAP)


def locate(b: bytes, key: str, n: int) -> tuple[int, tuple[str, ...]] | None:
    """(offset of item n of the top-level list `key`, the keys before that list), or None
    when the body does not have that shape (not an object, the key twice before it, a
    shorter list)."""
    try:
        i = ws(b, 0)
        if b[i] != 0x7B:
            return None
        i = ws(b, i + 1)
        before: list[str] = []
        while b[i] == 0x22:
            end = string_end(b, i)
            name = orjson.loads(b[i:end])
            i = ws(b, end)
            if b[i] != 0x3A:  # ':'
                return None
            i = ws(b, i + 1)
            if name == key:
                if b[i] != 0x5B:
                    return None
                first = ws(b, i + 1)
                if b[first] == 0x5D:
                    return None
                off = skip_items(b, first, n)
                return None if off is None else (off, tuple(before))
            if name in before:
                return None
            before.append(name)
            i = ws(b, value_end(b, i))
            if b[i] != 0x2C:
                return None
            i = ws(b, i + 1)
    except (IndexError, ValueError, orjson.JSONDecodeError):
        return None
    return None


def _says(rec: Splice, payload: dict[str, Any]) -> bool:
    """Does the record's prefix alone say what the body's parse holds for it (the keys
    before the list, the list's first `count` items)? Not when a key comes again after
    the prefix (orjson keeps the last value; locate found the first list): a body that
    starts with the same bytes would be handed those values."""
    head = rec.prefix.rstrip(b" \t\n\r")
    if not head.endswith(b","):
        return False
    try:
        alone = orjson.loads(head[:-1] + b"]}")
    except orjson.JSONDecodeError:
        return False
    want = {k: payload[k] for k in rec.before}
    want[rec.key] = payload[rec.key][: rec.count]
    return bool(alone == want)


def _parse_from(key: str, rest: bytes) -> dict[str, Any] | None:
    """`rest` (a body from the start of an item of its list `key` on) parsed as
    `{"<key>":[` + rest, or None when that is not valid JSON."""
    try:
        out: dict[str, Any] = orjson.loads(b'{"' + key.encode() + b'":[' + rest)
    except orjson.JSONDecodeError:
        return None
    return out


def _at_last_item(b: bytes, key: str, payload: dict[str, Any]) -> Splice | None:
    """Fast way for a client that writes compact JSON as orjson does: find the last
    item's bytes from the end, and keep the offset only if the body from there parses
    as exactly that item and the keys after the list."""
    items = payload[key]
    try:
        off = b.rfind(orjson.dumps(items[-1]))
    except orjson.JSONEncodeError:  # nested deeper than orjson writes: found by the scanner
        return None
    if off <= 0:
        return None
    names = list(payload)
    at = names.index(key)
    tail = _parse_from(key, b[off:])
    expect = {key: [items[-1]], **{k: payload[k] for k in names[at + 1:]}}
    if tail is None or tail != expect or list(tail) != list(expect):
        return None
    return Splice(b[:off], len(items) - 1, tuple(names[:at]), key)


def make(b: bytes, key: str, payload: dict[str, Any], src: Splice | None,
         scan: bool = True, spans: bool = False) -> Splice | None:
    """The splice record for body `b` (parsed: `payload`) at the start of its last item;
    `src`, the record `b` was spliced with, lets only the new items be scanned. `scan`:
    search the prefix for MARKERS (only eviction off reads the result; without it the
    record says it does not know, and the whole body is searched). `spans`: keep the
    items' spans (what cutting the next body needs; found from `src`'s plus the new
    items', or, the first time, by scanning the body's members)."""
    items = payload.get(key)
    if type(items) is not list or len(items) < 2:
        return None
    n = len(items) - 1
    try:
        if src is not None and src.key == key and src.count <= n:
            walked = _walk(b, len(src.prefix), n - src.count)
            if walked is None:
                return None
            off, new = walked
            clean = src.unmarked
            if not scan:
                clean = None
            elif clean is None:  # the record it was spliced with was not searched
                clean = unmarked(b, 0, off)
            elif clean:  # only the new items
                clean = unmarked(b, max(0, len(src.prefix) - _OVERLAP), off)
            known = src.spans + tuple(new) if spans and src.spans is not None else None
            rec = Splice(b[:off], n, src.before, key, clean, known)
            return _with_spans(rec, b, payload) if spans and known is None else rec
        fast = _at_last_item(b, key, payload)
        if fast is None:
            found = locate(b, key, n)
            if found is None:
                return None
            fast = Splice(b[: found[0]], n, found[1], key)
            if not _says(fast, payload):
                return None
    except (IndexError, ValueError):
        return None
    if spans:
        fast = _with_spans(fast, b, payload)
    return replace(fast, unmarked=unmarked(fast.prefix)) if scan else fast


def _walk(b: bytes, off: int, n: int) -> tuple[int, list[Span]] | None:
    """jsonbytes.skip_items, with the spans of the `n` items passed over."""
    out: list[Span] = []
    for _ in range(n):
        end = value_end(b, off)
        out.append((off, end))
        off = ws(b, end)
        if b[off] != 0x2C:  # ',' - anything else: the list ended
            return None
        off = ws(b, off + 1)
    return None if b[off] == 0x5D else (off, out)


def _with_spans(rec: Splice, b: bytes, payload: dict[str, Any]) -> Splice:
    """`rec` with the spans of its items, read from the list orjson read in `b` (the
    last of that name); unchanged if that list does not start the way `rec` says."""
    try:
        found = [m for m in members(b, ws(b, 0), payload, listed=rec.key)
                 if m.name == rec.key][-1].items
    except (IndexError, ValueError):
        return rec
    if found is None or len(found) <= rec.count or found[rec.count][0] != len(rec.prefix):
        return rec
    return replace(rec, spans=tuple(found[: rec.count]))


def spans_of(b: bytes, rec: Splice, values: list[Any]) -> list[Span] | None:
    """The spans of every item of body `b`, spliced with `rec` (its items: `values`):
    the record's for its prefix, the new items' scanned; None when the record kept none
    or they do not add up to `values`."""
    if rec.spans is None or len(values) <= rec.count or not b.startswith(rec.prefix):
        return None
    try:
        new = spans_from(b, len(rec.prefix), values[rec.count:])
    except (IndexError, ValueError):
        return None
    if len(new) != len(values) - rec.count:
        return None
    return [*rec.spans, *new]


def loads(b: bytes, rec: Splice, prev_payload: dict[str, Any]) -> dict[str, Any] | None:
    """`orjson.loads(b)` from the previous body's parse (`prev_payload`, the body the
    record was made from), when `b` starts with the record's prefix and the rest can be
    vouched for; else None."""
    off = len(rec.prefix)
    if len(b) <= off or not b.startswith(rec.prefix):
        return None
    rest = b[off:]
    quoted = b'"' + rec.key.encode() + b'"'
    if quoted in rest or _ASCII_ESCAPE.search(rest):  # the key again, or a key spelled escaped
        return None
    tail = _parse_from(rec.key, rest)  # None: the full parse gives the client the real error
    if tail is None:
        return None
    new = tail.get(rec.key)
    if type(new) is not list or not new or any(k in tail for k in rec.before):
        return None
    out = {k: prev_payload[k] for k in rec.before}
    out[rec.key] = prev_payload[rec.key][: rec.count] + new
    for k, v in tail.items():
        if k != rec.key:
            out[k] = v
    return out
