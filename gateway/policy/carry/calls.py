"""Tool calls as the carry-over reads them: what an agent's call touched and wrote.

A wire hands each call over in a neutral form, `ToolCall`: the tool's name and the JSON
text of its arguments, of which only the first CALL_CHARS characters are read (a 1 MB
Write costs what its first 16K characters cost). That head is read without being parsed
whole, since it may stop inside a string: each string value with the argument name it
sits under. Then, by the rules of carry.yaml's `tool_calls`: a path argument is taken
whole (written, when the tool writes), a working-directory argument sets the working
directory, file contents are not read, and other text is read with the ref patterns
and the patterns for relative paths, `cd`, redirects and a patch's file headers (a
command's inline file content — a heredoc, a patch body — only for the headers).
Pure; cached by the call's name and head.
"""

from __future__ import annotations

import posixpath
import re
import sys
from collections.abc import Iterable
from typing import NamedTuple

import orjson

from gateway.config.carry import CarryPatterns
from gateway.config.carry_calls import CallRules
from gateway.measure.bounded import BoundedMemo

CALL_CHARS = 16_384  # of a call's arguments text, what is read
MAX_PATH = 400  # a longer value is not a path


class ToolCall(NamedTuple):
    """One tool call, whatever the wire: the tool's name and its arguments' JSON text
    (a wire may give only its first CALL_CHARS characters: nothing past them is read)."""

    name: str
    arguments: str


class CallFacts(NamedTuple):
    refs: tuple[tuple[str, str], ...]  # (type, value) the call names, in order
    written: tuple[tuple[str, str], ...]  # (type, value) of the files it writes
    workdir: str | None  # its working-directory argument
    cd: str | None  # the last directory its commands move to


def refs_in(p: CarryPatterns, text: str, mask: int) -> list[tuple[str, str]]:
    """(type, value) in text order; a span already taken by an earlier pattern (a path)
    is not matched again by a later one (a service name inside that path). `mask`:
    the patterns that may match, from `p.prefilter.scan(text)`."""
    return [(t, v) for _, t, v in sorted(_found(p.ref_bits, text, mask))]


def _found(patterns: Iterable[tuple[str, re.Pattern[str], int]], text: str, mask: int,
           taken: list[tuple[int, int]] | None = None) -> list[tuple[int, str, str]]:
    """(start, type, value) of each match not overlapping one taken before (`taken`,
    extended), of the patterns whose bit is in `mask`."""
    taken = [] if taken is None else taken
    found: list[tuple[int, str, str]] = []
    for rtype, pat, bit in patterns:
        if not mask & bit:  # none of its fixed strings is in the text
            continue
        for mt in pat.finditer(text):
            a, b = mt.span()
            if any(a < y and x < b for x, y in taken):
                continue
            taken.append((a, b))
            found.append((a, rtype, mt.group(0)))
    return found


# a string (its closing quote optional: the head may end inside it) or a structural mark;
# the unrolled loop cannot backtrack
_TOKEN = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)(")?|[{}\[\],]', re.DOTALL)
# where a string's text may be cut without cutting a word: a space, or a newline or tab
# escape (after an even run of backslashes: escaped backslashes)
_WORD_END = re.compile(r" |(?<!\\)(?:\\\\)*\\[nt]")


def _decoded(body: str) -> str | None:
    try:
        value = orjson.loads('"' + body + '"')
    except orjson.JSONDecodeError:  # a raw control character, a bad escape
        return None
    return value if isinstance(value, str) else None


def _whole_words(body: str) -> str | None:
    """A string the head ends inside: up to its last space or line break (a path cut
    short is no path)."""
    last = None
    for last in _WORD_END.finditer(body):  # noqa: B007 - the last one is wanted
        continue
    if last is None:
        return None
    return _decoded(body[: last.end() - (1 if last.group() == " " else 2)])


def json_strings(text: str, skip: frozenset[str]) -> list[tuple[str | None, str]]:
    """Every string value of a JSON text's head with the name of the member it sits under
    (an array's elements: the member holding the array; None at the top), in order;
    nothing under a member named in `skip`. A string the head ends inside gives its
    words up to its last space or line break. A text that is no JSON object, array or
    string is one value."""
    first = text.lstrip()[:1]
    if first not in ("{", "[", '"'):
        return [(None, text)] if first else []
    out: list[tuple[str | None, str]] = []
    # per open container: [is an object, its current member's name, a name comes next]
    stack: list[list[object]] = []
    for m in _TOKEN.finditer(text):
        body = m.group(1)
        if body is None:
            mark = m.group()
            if mark in "{[":
                stack.append([mark == "{", None, mark == "{"])
            elif mark in "}]":
                if stack:
                    stack.pop()
            elif stack and stack[-1][0]:  # a comma in an object: a name comes next
                stack[-1][2] = True
            continue
        if stack and stack[-1][2]:
            stack[-1][1], stack[-1][2] = _decoded(body), False
            continue
        names = [f[1] for f in stack if f[0]]
        if any(n in skip for n in names):
            continue
        value = _decoded(body) if m.group(2) else _whole_words(body)
        if value:
            owner = names[-1] if names else None
            out.append((owner if isinstance(owner, str) else None, value))
    return out


def _as_path(c: CallRules, value: str) -> str | None:
    v = value.strip()
    if not v or len(v) > MAX_PATH or "\n" in v or "\r" in v or c.not_paths.search(v):
        return None
    return v


def _type_of(p: CarryPatterns, value: str) -> str:
    """The ref type a path is of when text names it so (`report.csv`: file), else path."""
    for rtype, pat in p.refs:
        if pat.fullmatch(value):
            return rtype
    return "path"


def _group(m: re.Match[str]) -> str:
    return next((g for g in m.groups() if g), "")


def _text_facts(p: CarryPatterns, value: str, refs: list[tuple[str, str]],
                written: list[str]) -> str | None:
    """Read one text value (a command, a prompt, a patch) into `refs` and `written`; the
    last directory it moves to."""
    c = p.calls
    body = c.body_start.search(value)
    head = value[: body.start()] if body is not None else value
    taken: list[tuple[int, int]] = []
    found = _found(p.ref_bits, head, p.prefilter.scan(head), taken)
    found += _found((("path", c.command_paths, 1),), head, 1, taken)
    refs += [(t, v) for _, t, v in sorted(found) if _as_path(c, v) is not None]
    written += [_group(m) for m in c.redirects.finditer(head)]
    written += [_group(m) for m in c.patch_files.finditer(value)]
    cds = [_group(m) for m in c.cd.finditer(head)]
    return cds[-1] if cds else None


def _facts(p: CarryPatterns, name: str, head: str) -> CallFacts:
    c = p.calls
    refs: list[tuple[str, str]] = []
    written: list[str] = []
    workdir = cd = None
    writes = name in c.write_tools
    for owner, value in json_strings(head, c.skip_args):
        if owner in c.workdir_args:
            workdir = _as_path(c, value) or workdir
        elif owner in c.path_args:
            path = _as_path(c, value)
            if path is not None and writes:
                written.append(path)
            elif path is not None:
                refs.append((_type_of(p, path), path))
        else:
            cd = _text_facts(p, value, refs, written) or cd
    files = dict.fromkeys(w for w in (_as_path(c, x) for x in written) if w is not None)
    # a file written is not also one touched, nor the directory moved to a file
    named = {*files, cd, workdir}
    return CallFacts(tuple((t, v) for t, v in refs if v not in named),
                     tuple((_type_of(p, v), v) for v in files), workdir, cd)


def moved(workdir: str | None, cd: str) -> str | None:
    """The working directory after `cd` (a relative one needs a known start)."""
    if cd.startswith("/"):
        return posixpath.normpath(cd)
    if workdir is None or cd.startswith(("-", "~", "$")):
        return workdir
    return posixpath.normpath(posixpath.join(workdir, cd))


_PATTERNS: list[CarryPatterns] = []  # the patterns the cache was filled with


def call_facts(p: CarryPatterns, call: ToolCall) -> CallFacts:
    """What one call names, writes and where it runs (cached: a cold history is read
    whole, call after call)."""
    if not _PATTERNS or _PATTERNS[0] is not p:  # a reload: start a fresh cache
        _PATTERNS[:] = [p]
        FACTS.clear()
    key = (call.name, call.arguments[:CALL_CHARS])
    facts = FACTS.get(key)
    if facts is None:
        facts = _facts(p, *key)
        FACTS.put(key, facts, sys.getsizeof(key[0]) + sys.getsizeof(key[1]) + 300
                  + sum(sys.getsizeof(v) for _, v in facts.refs + facts.written))
    return facts


# by (name, arguments up to CALL_CHARS): bounded by entries and bytes (limits.cache_mb)
FACTS: BoundedMemo[tuple[str, str], CallFacts] = BoundedMemo(4096, 16 << 20)
