"""Load rules/carry.yaml: ref patterns, deictics, task-state cues, the note template."""

from __future__ import annotations

import functools
import operator
import re
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from re import _casefix, _constants, _parser  # type: ignore[attr-defined]
from typing import Any

import ahocorasick_rs

from gateway.config.carry_calls import SHIPPED_CALLS, CallRules, load_call_rules
from gateway.config.yamlfile import load_yaml
from gateway.errors import RulesError

PICKS = ("latest", "earlier", "later")


@dataclass(frozen=True, slots=True)
class Deictic:
    pattern: re.Pattern[str]
    types: tuple[str, ...] | None  # the ref types it may mean (None: any)
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
    calls: CallRules = SHIPPED_CALLS  # how agents' tool calls are read (`tool_calls`)
    # False (MEMGATE_SHORTCUTS_OFF=prefilter): every regex runs on every text; the same
    # matches, only slower
    prefilter_on: bool = True
    prefilter: Prefilter = field(init=False, compare=False, repr=False)
    # (type, pattern, its prefilter bit) per ref pattern, in order
    ref_bits: tuple[tuple[str, re.Pattern[str], int], ...] = field(
        init=False, compare=False, repr=False)
    # (index in deictics, pattern, its bit) per deictic
    deictic_bits: tuple[tuple[int, re.Pattern[str], int], ...] = field(
        init=False, compare=False, repr=False)
    # one bit per other searched pattern, and the union of the ref and of the deictic
    # bits: a text none of whose strings any ref (deictic) pattern needs skips them all
    bits: dict[str, int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        pre = Prefilter(self.searched_patterns(), self.prefilter_on)
        ref_bits = tuple((rtype, pat, pre.bit(pat)) for rtype, pat in self.refs)
        deictic_bits = tuple((k, d.pattern, pre.bit(d.pattern))
                             for k, d in enumerate(self.deictics))
        bits = {name: pre.bit(getattr(self, name))
                for name in ("create", "ask", "close", "output_verbs")}
        bits["refs"] = functools.reduce(operator.or_, (b for _, _, b in ref_bits), 0)
        bits["deictics"] = functools.reduce(operator.or_, (b for _, _, b in deictic_bits), 0)
        object.__setattr__(self, "prefilter", pre)
        object.__setattr__(self, "ref_bits", ref_bits)
        object.__setattr__(self, "deictic_bits", deictic_bits)
        object.__setattr__(self, "bits", bits)

    def all_patterns(self) -> list[re.Pattern[str]]:
        return [*self.searched_patterns(), self.small_talk]

    def searched_patterns(self) -> list[re.Pattern[str]]:
        """The patterns searched anywhere in a text: the prefilter's. Not small_talk, only
        ever tried at a text's start (`match`: a few comparisons), whose fixed strings
        occur inside common words ("hi" in "this", "ok" in "look"): in the automaton they
        were most of its matches, each one a step of the scan's Python loop."""
        return [*(pat for _, pat in self.refs), *(d.pattern for d in self.deictics),
                self.create, self.ask, self.close, self.output_verbs]


_ZERO_WIDTH = {_constants.AT, _constants.ASSERT, _constants.ASSERT_NOT}
_MAX_STRINGS = 64  # a fixed node set larger than this ends the run


def _case_classes() -> dict[int, str]:
    """Code point -> representative of the characters `re.IGNORECASE` treats as one
    (sre compares simple lowercases, plus these extra pairs such as s/ſ and i/ı)."""
    parent: dict[int, int] = {}

    def find(c: int) -> int:
        while parent.get(c, c) != c:
            c = parent[c]
        return c

    for lo, others in _casefix._EXTRA_CASES.items():
        for o in others:
            a, b = find(lo), find(o)
            if a != b:
                parent[max(a, b)] = min(a, b)
    members = set(parent) | set(parent.values())
    return {c: chr(find(c)) for c in members if find(c) != c}


_REP = _case_classes()
_REP_CHARS = re.compile("[" + "".join(map(re.escape, map(chr, _REP))) + "]")
_FULL_LOWER = {0x130: "i"}  # the one code point whose str.lower() is not its simple lowercase


def fold(text: str) -> str:
    """`text` as `re.IGNORECASE` compares it, one character for one: the simple lowercase
    of each character mapped to its case class. A literal matches case-insensitively at
    a position exactly where `fold(literal)` equals `fold(text)` there."""
    if text.isascii():
        return text.lower()
    if "\u0130" in text:
        text = text.translate(_FULL_LOWER)
    low = text.lower()
    return low.translate(_REP) if _REP_CHARS.search(low) else low


def _fixed(op: Any, av: Any) -> set[str] | None:
    """Every string a node can match, when that is a small finite set."""
    if op is _constants.LITERAL:
        return {chr(av)}
    if op is _constants.IN and all(o is _constants.LITERAL for o, _ in av):
        return {chr(a) for _, a in av} or None
    if op is _constants.SUBPATTERN and not av[1] and not av[2]:
        return _fixed_seq(av[3])
    if op is _constants.BRANCH:
        out: set[str] = set()
        for branch in av[1]:
            s = _fixed_seq(branch)
            if s is None:
                return None
            out |= s
        return out if len(out) <= _MAX_STRINGS else None
    return None


def _fixed_seq(seq: Any) -> set[str] | None:
    out = {""}
    for op, av in seq:
        if op in _ZERO_WIDTH:
            continue
        s = _fixed(op, av)
        if s is None or len(out) * len(s) > _MAX_STRINGS:
            return None
        out = {a + b for a in out for b in s}
    return out


def _score(s: set[str] | None) -> tuple[int, int]:
    return (min(map(len, s)), -len(s)) if s else (0, 0)


def _needed(seq: Any) -> set[str] | None:
    """A set of strings at least one of which every match of `seq` contains (None: no
    such set found): the best run of consecutive fixed nodes, or what a mandatory group,
    repeat or alternation needs inside."""
    best: set[str] | None = None
    run: set[str] = {""}
    for op, av in seq:
        if op in _ZERO_WIDTH:
            continue
        s = _fixed(op, av)
        if s is not None and len(run) * len(s) <= _MAX_STRINGS:
            run = {a + b for a in run for b in s}
        else:
            if _score(run) > _score(best):
                best = run
            run = s if s is not None else {""}
        if s is None:
            inner: set[str] | None = None
            if op is _constants.SUBPATTERN:
                inner = _needed(av[3])
            elif op in (_constants.MAX_REPEAT, _constants.MIN_REPEAT) and av[0] >= 1:
                inner = _needed(av[2])
            elif op is _constants.BRANCH:
                parts = [_needed(b) for b in av[1]]
                if all(parts):
                    inner = set().union(*parts)  # type: ignore[arg-type]
            if _score(inner) > _score(best):
                best = inner
    if _score(run) > _score(best):
        best = run
    return best if _score(best)[0] > 0 else None


def _flags_change(seq: Any) -> bool:
    """True when a group sets or clears flags inside the pattern (e.g. `(?-i:...)`)."""
    for op, av in seq:
        if op is _constants.SUBPATTERN:
            if av[1] or av[2] or _flags_change(av[3]):
                return True
        elif op is _constants.BRANCH:
            if any(_flags_change(b) for b in av[1]):
                return True
        elif op in (_constants.MAX_REPEAT, _constants.MIN_REPEAT, _constants.POSSESSIVE_REPEAT):
            if _flags_change(av[2]):
                return True
        elif ((op in (_constants.ASSERT, _constants.ASSERT_NOT) and _flags_change(av[1]))
              or (op is _constants.ATOMIC_GROUP and _flags_change(av))):
            return True
    return False


@functools.lru_cache(maxsize=512)
def required(pattern: re.Pattern[str]) -> tuple[tuple[str, ...], bool] | None:
    """(strings, folded): every match of `pattern` contains one of these strings —
    compared on `fold(text)` when `folded` (the pattern ignores case) — or None.

    Taken from the pattern's parse: its longest run of fixed pieces (literal characters,
    small character sets, alternations of fixed strings), or what each branch of a
    top-level alternation needs. Most messages contain none of a pattern's fixed
    strings ("/", "服务", "that file"), and a few substring searches replace a scan with
    backtracking; Python's regex engine tries every position of an alternation.
    """
    if pattern.flags & re.ASCII and pattern.flags & re.IGNORECASE:
        return None  # ASCII-only case folding: not what fold() models
    try:
        tree = _parser.parse(pattern.pattern, pattern.flags)
    except Exception:  # noqa: BLE001 - a prefilter is optional, the pattern still works
        return None
    if _flags_change(tree):
        return None
    need = _needed(tree)
    if need is None:
        return None
    icase = bool(pattern.flags & re.IGNORECASE)
    return tuple(sorted({fold(s) if icase else s for s in need})), icase


@functools.cache
def _folded_by_fold() -> tuple[str, ...]:
    """Every non-ASCII character that fold() changes (capitals, ſ, ı, K, ς, ...): a text
    without any of them folds to its ASCII lowercase."""
    cps = array("I", range(0x80, 0x130))
    cps.extend(range(0x131, 0xD800))  # U+0130: the one whose lower() is two characters
    cps.extend(range(0xE000, 0x110000))
    chars = cps.tobytes().decode("utf-32-le")
    low = chars.lower()
    out = {"\u0130", *(chr(c) for c in _REP if chr(c).lower() == chr(c))}
    for k in range(0, len(chars), 512):  # compare blocks; only differing ones per character
        a, b = chars[k:k + 512], low[k:k + 512]
        if a != b:
            out.update(x for x, y in zip(a, b, strict=True) if x != y)
    return tuple(sorted(out))


_UNFOLDED = 1  # the mask bit the characters of _folded_by_fold() set


class Prefilter:
    """Which of a rule set's patterns may match a text, from one Aho-Corasick pass.

    Every pattern's `required()` strings go into one automaton; a pattern none of whose
    strings occur in a text certainly has no match there, and its regex is not run.
    One pass over the text's UTF-8 replaces a substring search per string (~120 for
    the shipped rules). Case-insensitive strings are compared on the text's ASCII
    lowercase, exactly `fold(text)` unless the text holds a character fold() changes
    (those are strings of the automaton too: such a text is scanned again, folded)."""

    def __init__(self, patterns: Iterable[re.Pattern[str]], on: bool = True) -> None:
        self.patterns = list(dict.fromkeys(patterns))
        # keyed by id: hashing a compiled pattern hashes its whole program, every time
        self._bit = {id(pat): 2 << k for k, pat in enumerate(self.patterns)}
        self.always = 0  # patterns without fixed strings: always run
        plain: dict[str, int] = {}
        folded: dict[str, int] = {}
        for pattern in self.patterns:
            b = self._bit[id(pattern)]
            need = required(pattern) if on else None  # off: every pattern always runs
            if need is None:
                self.always |= b
                continue
            strings, icase = need
            into = folded if icase else plain
            for s in strings:
                into[s] = into.get(s, 0) | b
        self._plain = _Automaton.of(plain)
        self._folded = _Automaton.of(folded)
        self._lowered = _Automaton.of(folded and {
            **folded, **{c: folded.get(c, 0) | _UNFOLDED for c in _folded_by_fold()}})

    def scan(self, text: str) -> int:
        """A mask of the patterns that may match `text`."""
        mask = self.always
        if self._plain is None and self._lowered is None:  # off, or no fixed strings at all
            return mask
        raw = text.encode("utf-8", "surrogatepass")
        if self._plain is not None:
            mask |= self._plain.scan(raw)
        if self._lowered is not None and self._folded is not None:
            hit = self._lowered.scan(raw.lower())
            if hit & _UNFOLDED:
                hit = self._folded.scan(fold(text).encode("utf-8", "surrogatepass"))
            mask |= hit
        return mask

    def bit(self, pattern: re.Pattern[str]) -> int:
        """`pattern`'s bit in the masks `scan` returns."""
        return self._bit[id(pattern)]

    def may_match(self, pattern: re.Pattern[str], mask: int) -> bool:
        """False only when `pattern` certainly has no match in the text `mask` came from."""
        return bool(mask & self._bit[id(pattern)])


class _Automaton:
    """Strings -> masks; `scan` ORs the masks of the strings a UTF-8 text contains."""

    def __init__(self, strings: dict[str, int]) -> None:
        # on UTF-8 bytes: a string occurs in a text exactly where its encoding occurs in the
        # text's encoding, and no character offsets have to be worked out
        self._masks = list(strings.values())
        self._ac = ahocorasick_rs.BytesAhoCorasick(
            [s.encode("utf-8", "surrogatepass") for s in strings],
            implementation=ahocorasick_rs.Implementation.DFA)

    @classmethod
    def of(cls, strings: dict[str, int]) -> _Automaton | None:
        return cls(strings) if strings else None

    def scan(self, utf8: bytes) -> int:
        masks, mask = self._masks, 0
        for k, _, _ in self._ac.find_matches_as_indexes(utf8, overlapping=True):
            mask |= masks[k]
        return mask


def _compile(file: str, key: str, pattern: Any) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise RulesError(file, None, key, "must be a non-empty regular expression")
    try:
        return re.compile(pattern, re.IGNORECASE | re.MULTILINE)
    except re.error as exc:
        raise RulesError(file, None, key, f"invalid regular expression: {exc}") from None


def load_carry_patterns(path: Path) -> CarryPatterns:
    file = str(path)
    data, _ = load_yaml(path)  # within bounds: it is hot-reloaded with the config
    if not isinstance(data, dict):
        raise RulesError(file, None, "<file>", "must be a mapping")
    unknown = set(data) - {"refs", "deictics", "task_state", "small_talk", "output_verbs", "note",
                           "tool_calls"}
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
        given, pick = d.get("type", "any"), d.get("pick", "latest")
        names = [given] if isinstance(given, str) else given  # one ref type, or a list
        if given == "any":
            dtypes = None
        elif (isinstance(names, list) and names
              and all(isinstance(t, str) and t in types for t in names)):
            dtypes = tuple(names)
        else:
            raise RulesError(file, None, f"{key}.type",
                             f"must be a ref type ({', '.join(sorted(types))}), any, or a "
                             f"non-empty list of ref types; got {given!r}")
        if pick not in PICKS:
            raise RulesError(file, None, f"{key}.pick", f"must be one of {', '.join(PICKS)}")
        deictics.append(Deictic(_compile(file, f"{key}.pattern", d.get("pattern")), dtypes, pick))
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
        calls=load_call_rules(file, data.get("tool_calls")),
    )
