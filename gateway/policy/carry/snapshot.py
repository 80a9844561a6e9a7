"""Per-turn fields (MemT) and the minimal snapshot later turns still need.

A deterministic fold over the visible history, message by message: extract
refs, resolve deictic phrases ("刚才那个路径", "the previous one") against refs
seen before, follow the task state, record a confirmed constraint when the user
answers the assistant's question. An agent's tool calls are folded too (calls.py):
the paths they name and the files they write are refs, their working directory and
the closing text of the last task that made calls are kept. Then the drop conditions
remove what no later turn needs. Pure: no I/O; what was skipped is returned for the
caller to log.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter
from typing import Any, NamedTuple

from gateway.config.carry import CarryPatterns, Deictic
from gateway.config.schema import CarryRules
from gateway.measure.bounded import BoundedMemo
from gateway.policy.carry.calls import ToolCall, call_facts, moved, refs_in

FILE_TYPES = ("path", "file")  # the ref types a tool call's touched files are of
MAX_CONCLUSION = 200  # characters of a task's closing sentence


@dataclass(frozen=True, slots=True)
class Message:
    """One message as the carry-over sees it."""

    turn: int
    role: str  # user | assistant | tool
    text: str
    calls: tuple[ToolCall, ...] = ()  # an assistant's tool calls, after its text


@dataclass(frozen=True, slots=True)
class _Ref:
    """Immutable: a mention replaces it, so a checkpoint copies references, not refs."""

    type: str
    value: str
    first_turn: int
    last_turn: int
    seq: int  # the fold's mention count when last mentioned: the mention order
    tool_turn: int | None = None  # the last turn a tool call named it
    written_turn: int | None = None  # the last turn a tool call wrote it


@dataclass(slots=True)
class Snapshot:
    fields: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (field or item, reason)

    def get(self, dotted: str) -> Any:
        """`resolved_refs.刚才那个路径` style lookup; None when absent."""
        if dotted in self.fields:
            return self.fields[dotted]
        head, _, rest = dotted.partition(".")
        node = self.fields.get(head)
        return node.get(rest) if isinstance(node, dict) and rest else None

    def __contains__(self, dotted: str) -> bool:
        return self.get(dotted) is not None

    @property
    def count(self) -> int:
        return len(self.fields)


def _sentences_with_question(text: str) -> str:
    if "?" not in text and "？" not in text:
        return text.strip()[:160]
    parts = re.split(r"(?<=[。！？!?\n])|(?<=\.)\s+", text)
    asked = [p.strip() for p in parts if p.strip().endswith(("？", "?"))]
    return asked[-1] if asked else text.strip()[:160]


_CLAUSE_END = re.compile(r"[，,。；;.!！]")
_CLAUSES = re.compile(r"[，,；;、]")


def _asked(question: str) -> str | None:
    """What a question asks, to tell it asked again: its last clause, spaces gone ("确认
    按状态分组输出 CSV，是否排除已取消订单？" and "是否排除已取消订单？" ask one thing);
    None when that is too short to tell one question from another ("ok?")."""
    last = "".join(_CLAUSES.split(question)[-1].split())
    return last if len(last) >= 6 else None
_NOT_SPACE = re.compile(r"\S")
_LINE_END = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")  # str.splitlines'


def _first_line(text: str, limit: int | None = None) -> str | None:
    """text.strip().splitlines()[0][:limit] (None for a blank text) without copying or
    splitting the rest of a long tool result, nor searching a long first line past
    `limit`."""
    start = _NOT_SPACE.search(text)
    if start is None:
        return None
    a = start.start()
    if limit:
        head = text[a:a + limit]
        if _LINE_END.search(head) is None and not head[-1].isspace():
            # the first line runs to `limit` at least, and rstrip() cannot shorten it
            # below that: text[a] is not a space and neither is head's last character
            return head
    end = _LINE_END.search(text, a)
    if end is None or _NOT_SPACE.search(text, end.start()) is None:  # one line, once stripped
        line = text[a:].rstrip()
    else:
        line = text[a:end.start()]
    return line if limit is None else line[:limit]


def _first_clause(text: str) -> str:
    """The text up to its first clause mark, stripped, at most 120 characters."""
    m = _CLAUSE_END.search(text)
    return (text[: m.start()] if m else text).strip()[:120]


_SENTENCE_END = re.compile(r"[。！？]|[.!?](?=[*_`'\")\]]*(?:\s|$))")  # "**Done.** More"
_MARKUP = "#>*-_` \t"


def _closing_sentence(text: str) -> str | None:
    """What a task's closing text concluded: its first sentence, from the first line that
    is not a heading, markdown marks stripped, at most MAX_CONCLUSION characters; only
    the text's first 2,000 characters are looked at."""
    lines = [x.strip() for x in _LINE_END.split(text[:2000])]
    said = [x for x in lines if x.strip(_MARKUP)]
    if not said:
        return None
    line = next((x for x in said if not x.startswith("#")), said[0]).strip(_MARKUP)
    m = _SENTENCE_END.search(line)
    return (line[: m.end()] if m else line)[:MAX_CONCLUSION].strip() or None


class _Extract(NamedTuple):
    """What the patterns find in one message (cached: a history is re-read every request).
    A named tuple: built for every message of a cold history, ~3x cheaper than a frozen
    dataclass."""

    small_talk: bool
    deictics: tuple[tuple[int, str], ...]  # (index in patterns.deictics, phrase)
    refs: tuple[tuple[str, str], ...]
    create: bool
    ask: bool
    close: bool
    output: bool
    question: str
    first_clause: str


_PATTERNS: list[CarryPatterns] = []  # the patterns the extraction cache was filled with


def _extract(p: CarryPatterns, role: str, text: str) -> _Extract:
    if not _PATTERNS or _PATTERNS[0] is not p:  # a reload: start a fresh cache
        _PATTERNS[:] = [p]
        EXTRACTED.clear()
    return _extract_cached(role, text)


def _extract_cached(role: str, text: str) -> _Extract:
    out = EXTRACTED.get((role, text))
    if out is None:
        out = _extract_uncached(role, text)
        EXTRACTED.put((role, text), out, extract_size(text, out))
    return out


def extract_size(text: str, out: _Extract) -> int:
    """Bytes an entry of the extraction cache holds: the text, the strings found in it,
    the key and the named tuple."""
    return (sys.getsizeof(text) + sys.getsizeof(out.question)
            + sys.getsizeof(out.first_clause) + 300)


def _extract_uncached(role: str, text: str) -> _Extract:
    p = _PATTERNS[0]
    mask = p.prefilter.scan(text)  # which patterns' fixed strings the text contains
    bits = p.bits
    refs = tuple(refs_in(p, text, mask)) if mask & bits["refs"] else ()
    if role != "user":
        return _Extract(
            small_talk=False, deictics=(), refs=refs, create=False,
            ask=bool(mask & bits["ask"]) and p.ask.search(text) is not None,
            close=bool(mask & bits["close"]) and p.close.search(text) is not None,
            output=False, question=_sentences_with_question(text), first_clause="")
    return _Extract(
        small_talk=p.small_talk.match(text) is not None,
        # a phrase the pattern matches in any case is one phrase ("It" at a sentence's
        # start is "it"): one entry in the note, not one per spelling
        deictics=tuple((k, m.group(0).lower() if pat.flags & re.IGNORECASE else m.group(0))
                       for k, pat, bit in p.deictic_bits if mask & bit
                       for m in pat.finditer(text)) if mask & bits["deictics"] else (),
        refs=refs,
        create=bool(mask & bits["create"]) and p.create.search(text) is not None,
        ask=False, close=False,
        output=bool(mask & bits["output_verbs"]) and p.output_verbs.search(text) is not None,
        question="", first_clause=_first_clause(text))


# every message of a history is read by the fold: by (role, text), bounded by entries and
# by bytes (by entries alone, 50,000 long tool outputs held gigabytes)
EXTRACT_BYTES = 16 << 20  # the default share (limits.cache_mb)
EXTRACTED: BoundedMemo[tuple[str, str], _Extract] = BoundedMemo(50_000, EXTRACT_BYTES)


class Fold:
    """The fold's state after some prefix of a history; `copy()` checkpoints it so a
    growing session folds only what was appended since the last request."""

    def __init__(self, p: CarryPatterns) -> None:
        self.p = p
        # (type, value) -> ref, in mention order (a mention moves it to the end): the
        # turns of the last mentions ascend, so the refs still fresh are a suffix
        self.refs: dict[tuple[str, str], _Ref] = {}
        # the same order per ref type, the types themselves by their latest mention: a
        # deictic looks at the last one or two refs of a type, not at every ref seen so far.
        # The candidate a deictic did not choose leaves `refs` but keeps its place here (a
        # key not in `refs`): it still stands between the older refs and the next deictic,
        # so no deictic reaches past the last two places of a type and a checkpoint that
        # forgot the older refs folds on exactly as one that kept them
        self.by_type: dict[str, dict[tuple[str, str], None]] = {}
        self.mentions = 0
        self.resolved: dict[str, str] = {}
        # ordered sets: a long session repeats the same phrases and values
        self.ambiguous: dict[str, None] = {}
        self.dropped_candidates: dict[str, None] = {}
        self.task_state: str | None = None
        self.pending_question: str | None = None
        self.constraints: list[str] = []
        self.output_file: str | None = None
        self.tool_results: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self.workdir: str | None = None  # where the agent's tool calls last ran
        self.worked: int | None = None  # the last turn that made tool calls
        # (turn, sentence): the assistant's latest text, while no call of its turn followed
        # it; and the last such text of a finished turn that made calls
        self.closing: tuple[int, str] | None = None
        self.concluded: tuple[int, str] | None = None

    def copy(self) -> Fold:
        c = Fold.__new__(Fold)
        c.p = self.p
        c.refs = dict(self.refs)
        c.by_type = {t: dict(keys) for t, keys in self.by_type.items()}
        c.mentions = self.mentions
        c.resolved = dict(self.resolved)
        c.ambiguous = dict(self.ambiguous)
        c.dropped_candidates = dict(self.dropped_candidates)
        c.task_state = self.task_state
        c.pending_question = self.pending_question
        c.constraints = list(self.constraints)
        c.output_file = self.output_file
        c.tool_results = list(self.tool_results)
        c.skipped = list(self.skipped)
        c.workdir, c.worked = self.workdir, self.worked
        c.closing, c.concluded = self.closing, self.concluded
        return c

    def _mention(self, rtype: str, value: str, turn: int, via: str = "text") -> None:
        """`via`: text, tool (a tool call named it) or written (a tool call wrote it)."""
        key = (rtype, value)
        ref = self.refs.pop(key, None)
        self.mentions += 1
        tool = turn if via != "text" else None if ref is None else ref.tool_turn
        written = turn if via == "written" else None if ref is None else ref.written_turn
        self.refs[key] = _Ref(rtype, value, turn if ref is None else ref.first_turn, turn,
                              self.mentions, tool, written)
        same = self.by_type.pop(rtype, None)  # re-added last: the latest mentioned type
        if same is None:
            same = {}
        else:
            same.pop(key, None)
        same[key] = None
        self.by_type[rtype] = same

    def _forget(self, rtype: str, key: tuple[str, str]) -> None:
        self.refs.pop(key, None)
        same = self.by_type.get(rtype)
        if same is not None:
            same.pop(key, None)
            if not same:
                del self.by_type[rtype]

    def prune(self, rules: CarryRules, turn: int) -> None:
        """Forget the refs that no snapshot from `turn` on can carry and no deictic can
        reach: mentioned more than ref_ttl_turns turns before it, not among the last two
        of their type, not what a resolved phrase or the output file names. (Resolving
        picks among the last two of a type and mentions its choice again; a forgotten
        ref mentioned again comes back as it would have been.) A session's checkpoint
        then holds what it still needs, not every path it ever named. Nothing is
        forgotten while what was left out is logged (`log_skipped`), and no ref while all
        refs are carried."""
        if rules.log_skipped:
            return
        self.skipped = []  # read only to log what was left out
        if not rules.no_pending_reference:
            return
        oldest = turn - rules.ref_ttl_turns
        live = self._named(output=True)  # a later snapshot may carry the output file
        stale = []
        for ref in self.refs.values():  # mention order: the stale refs come first
            if ref.last_turn >= oldest:
                break
            if ref.value not in live:
                stale.append((ref.type, (ref.type, ref.value)))
        # the places of unchosen candidates, once past the last two of their type
        stale += [(rtype, key) for rtype, same in self.by_type.items()
                  for key in list(same)[:-2] if key not in self.refs]
        for rtype, key in stale:
            if key not in self._last_places(rtype, 2):
                self._forget(rtype, key)

    def _named(self, output: bool) -> set[str]:
        """The ref values kept however old: what a resolved phrase names, and the output
        file when `output`."""
        live = set(self.resolved.values())
        if output and self.output_file:
            live.add(self.output_file)
        return live

    def _last_places(self, rtype: str, n: int) -> list[tuple[str, str]]:
        """The keys in the last n places of a type, oldest first (an unchosen candidate's
        place among them)."""
        same = self.by_type.get(rtype)
        if not same:
            return []
        out = list(islice(reversed(same), n))
        out.reverse()
        return out

    def _latest(self, rtype: str, n: int) -> list[_Ref | None]:
        """The refs in the last n places of a type (fewer if there are not so many),
        oldest first; None where an unchosen candidate keeps its place."""
        return [self.refs.get(k) for k in self._last_places(rtype, n)]

    def _types_newest_first(self) -> list[str]:
        """The ref types by their latest mention, newest first."""
        return list(reversed(self.by_type))

    def _resolve(self, d: Deictic, phrase: str, turn: int) -> bool:
        newest = self._types_newest_first()  # the types it may mean, latest mentioned first
        types = newest if d.types is None else [t for t in newest if t in d.types]
        need = 1 if d.pick == "latest" else 2
        for rtype in types:
            cands = self._latest(rtype, need)
            if len(cands) >= need:
                if d.pick == "latest":
                    chosen, other = cands[-1], None
                elif d.pick == "earlier":
                    chosen, other = cands[-2], cands[-1]
                else:
                    chosen, other = cands[-1], cands[-2]
                if chosen is None:  # the place of a candidate already let go: no ref
                    break
                self.resolved[phrase] = chosen.value
                self._mention(chosen.type, chosen.value, turn)
                if other is not None:  # the unchosen candidate: keep only its identifier
                    self.dropped_candidates[other.value] = None
                    self.refs.pop((other.type, other.value), None)  # its place stays
                return True
        self.ambiguous[phrase] = None
        return False

    def add(self, m: Message) -> None:
        self.add_text(m.turn, m.role, m.text)
        if m.calls:
            self.add_calls(m.turn, m.calls)

    def _close_before(self, turn: int) -> None:
        """A message of `turn` ends the turns before it: the closing text of one that
        made tool calls is what its task concluded."""
        c = self.closing
        if c is not None and c[0] < turn:
            if c[0] == self.worked:
                self.concluded = c
            self.closing = None

    def add_calls(self, turn: int, calls: Iterable[ToolCall]) -> None:
        """An assistant's tool calls (after its text): the paths they name and write are
        refs, their working directory the agent's; the turn is one that made calls, and
        a text before them closes nothing."""
        self._close_before(turn)
        for call in calls:
            f = call_facts(self.p, call)
            for rtype, value in f.refs:
                self._mention(rtype, value, turn, "tool")
            for rtype, value in f.written:
                self._mention(rtype, value, turn, "written")
            if f.workdir is not None:
                self.workdir = f.workdir
            elif f.cd is not None:
                self.workdir = moved(self.workdir, f.cd)
        self.worked = turn
        if self.closing is not None and self.closing[0] == turn:
            self.closing = None

    def add_text(self, turn: int, role: str, text: str) -> None:
        """`add(Message(turn, role, text))` without building the message."""
        self._close_before(turn)
        if role == "assistant" and text:
            said = _closing_sentence(text)
            if said is not None:
                self.closing = (turn, said)
        if role == "tool":
            first = _first_line(text, 160)
            if first is not None:
                self.tool_results = [*self.tool_results[-2:], first]
            return
        x = _extract(self.p, role, text)
        if x.small_talk:
            self.skipped.append((f"turn {turn}", "small_talk_only"))
            return
        resolved_now = [phrase for k, phrase in x.deictics
                        if self._resolve(self.p.deictics[k], phrase, turn)]
        for rtype, value in x.refs:
            self._mention(rtype, value, turn)
        files = [v for t, v in x.refs if t == "file"] if x.refs else ()
        if role == "user":
            if self.pending_question is not None:
                # the same question answered again: the new answer replaces the old
                asked = _asked(self.pending_question)
                if asked is not None:
                    self.constraints = [c for c in self.constraints
                                        if _asked(c.rsplit(" → ", 1)[0]) != asked]
                self.constraints.append(f"{self.pending_question} → {x.first_clause}")
                self.pending_question = None
                self.task_state = "in_progress"
            elif x.create and (x.refs or resolved_now):
                self.task_state = "created"
            if files and x.output:
                self.output_file = files[-1]
        elif role == "assistant":
            if x.ask and self.task_state in ("created", "in_progress"):
                self.pending_question = x.question
                self.task_state = "awaiting_user"
            elif x.close and self.task_state is not None:
                self.task_state = "closed"
                self.pending_question = None

    def snapshot(self, rules: CarryRules, current_turn: int, skipped: bool = True) -> Snapshot:
        """The fields later turns still need; `skipped`: also list what was left out and
        why (one entry per stale ref: the only part that costs what the history holds)."""
        out: dict[str, Any] = {}
        left_out = list(self.skipped) if skipped else []
        closed = self.task_state == "closed" and self.pending_question is None
        if closed and rules.task_closed:
            left_out += [(f, "task_closed") for f in ("task_state", "output_file",
                                                       "confirmed_constraints")]
        else:
            if self.task_state:
                out["task_state"] = self.task_state
            if self.output_file:
                out["output_file"] = self.output_file
            if self.constraints:
                out["confirmed_constraints"] = list(self.constraints)
        if self.workdir is not None:
            out["workdir"] = self.workdir
        concluded = self._concluded(current_turn)
        if concluded is not None:
            out["conclusion"] = concluded
        refs: dict[str, list[str]] = {}
        written: list[str] = []
        touched: list[str] = []
        oldest = current_turn - rules.ref_ttl_turns

        def fresh(turn: int | None) -> bool:
            return turn is not None and (turn >= oldest or not rules.no_pending_reference)

        for ref in self._carried_refs(rules, current_turn, out, left_out if skipped else None):
            if fresh(ref.written_turn):
                written.append(ref.value)
            elif ref.type in FILE_TYPES and fresh(ref.tool_turn):
                touched.append(ref.value)
            else:
                refs.setdefault(ref.type, []).append(ref.value)
        if written:
            out["files_written"] = written
        if touched:
            out["files_touched"] = touched
        if self.resolved:
            out["resolved_refs"] = dict(self.resolved)
        if refs:
            out["refs"] = refs
        if self.tool_results:
            out["tool_results"] = list(self.tool_results)
        if self.dropped_candidates:
            out["dropped_candidates"] = list(self.dropped_candidates)
        if self.ambiguous:
            out["ambiguous"] = list(self.ambiguous)
        kept = {k: v for k, v in out.items() if k in rules.keep_fields}
        if skipped:
            left_out += [(k, "not_in_keep_fields") for k in out if k not in rules.keep_fields]
        return Snapshot(kept, left_out)

    def _concluded(self, current_turn: int) -> str | None:
        """The closing sentence of the last task before `current_turn` that made calls."""
        c = self.closing
        if c is not None and c[0] < current_turn and c[0] == self.worked:
            return c[1]
        return self.concluded[1] if self.concluded is not None else None

    def _carried_refs(self, rules: CarryRules, current_turn: int, out: dict[str, Any],
                      left_out: list[tuple[str, str]] | None) -> list[_Ref]:
        """The refs the snapshot keeps, in mention order: those mentioned in the last
        ref_ttl_turns turns (a suffix of the mention order), and older ones a resolved
        phrase or the output file still points at; `left_out` gets one entry per other."""
        refs = self.refs
        if not rules.no_pending_reference:
            return list(refs.values())
        oldest = current_turn - rules.ref_ttl_turns  # fresh: last mentioned at or after
        live = self._named(output="output_file" in out)
        if left_out is not None:  # every ref is looked at anyway: one pass in order
            kept = []
            for ref in refs.values():
                if ref.last_turn < oldest and ref.value not in live:
                    left_out.append((f"refs.{ref.type}", "no_pending_reference"))
                else:
                    kept.append(ref)
            return kept
        fresh: list[_Ref] = []
        for key in reversed(refs):
            ref = refs[key]
            if ref.last_turn < oldest:
                break
            fresh.append(ref)
        fresh.reverse()
        older = [refs[k] for k in ((t, v) for t in self.by_type for v in live) if k in refs
                 and refs[k].last_turn < oldest]
        older.sort(key=attrgetter("seq"))  # back in mention order
        return older + fresh


def build_snapshot(
    messages: Iterable[Message], patterns: CarryPatterns, rules: CarryRules
) -> Snapshot:
    fold = Fold(patterns)
    current = 0
    for m in messages:
        fold.add(m)
        current = max(current, m.turn)
    return fold.snapshot(rules, current)
