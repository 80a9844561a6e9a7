"""Per-session cache of the parsed history: a growing session is parsed once.

Clients resend the whole history on every request, with new messages appended.
The cache keeps, per session, the previous request's items, the parse of
everything before its last turn (the *head*), the carry-over fold at the same
point and the per-message token counts. The next request is checked against
it with one C-level list comparison; when the head is still its prefix, only
the messages from there on are parsed, folded and counted.

A turn start (a user message that opens a turn) resets every parser's state,
so `parse(items)` equals the head's parse joined with the parse of the rest.
Anything unusual (an edited history, a rules reload, a piece that does not
parse on its own) falls back to the full parse: the cache only ever saves work.
Bounded (LRU) by entries and by the memory its entries are estimated to hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.decide import splice
from gateway.measure.conversation import Conversation, Group, Unplannable
from gateway.policy.carry import Fold
from gateway.policy.compact import ToolResult
from gateway.wire.base import Wire

SPLICE_MIN_BYTES = 16 << 10  # smaller bodies parse in microseconds: not worth the bytes kept
_HEAD = 512  # sessions are found by the first bytes of their bodies
_PER_HEAD = 32  # most recent sessions kept per distinct head


@dataclass(slots=True)
class Entry:
    rules: Any  # the Rules object the entry was built under (identity: a reload invalidates)
    wire: Wire
    items: list[Any]
    head: Conversation  # parse of items[:start]
    start: int  # the last turn start of `items`
    size: int
    tokens: list[int] = field(default_factory=list)  # per item, -1 = not counted
    token_key: Any = None  # the counter they came from (one per encoding and factor)
    fold: Fold | None = None  # carry-over fold after items[:start] (grouped messages)
    archived_upto: int = 0  # the complete turns starting before this item are archived
    # where the next body's new bytes may start: this request's record once made
    # (while the upstream answers), until then the one the previous entry had
    reuse: Reuse | None = None
    # the tool results of items[:start] and the tool names by call id there: where the
    # next request's scan for compactable results resumes (tool_results)
    tools: tuple[tuple[ToolResult, ...], dict[Any, str]] | None = None
    retrieve: bool = False  # the request carried the retrieval tool: so do the next ones


@dataclass(frozen=True, slots=True)
class Reuse:
    """A splice record with the parse of the body it was made from."""

    rec: splice.Splice
    payload: dict[str, Any]


@dataclass(slots=True)
class View:
    """What one request reuses: its parse, how many leading items are unchanged,
    and the previous entry's token counts and fold."""

    conv: Conversation
    known: int = 0  # items[:known] equal the previous request's
    prev: Entry | None = None
    entry: Entry | None = None  # this request's entry (fold and tokens filled in later)


def last_turn_start(wire: Wire, items: list[Any]) -> int | None:
    for i in range(len(items) - 1, -1, -1):
        if wire.starts_turn(items[i]):
            return i
    return None


def join(head: Conversation, tail: Conversation, at: int) -> Conversation:
    """head = parse(items[:at]), tail = parse(items[at:]) with items[at] a turn start."""
    t0 = head.n_turns
    groups = list(head.groups)
    groups.extend(
        Group([i + at for i in g.indices], g.turn + t0, g.is_user, g.chars, g.weight,
              [(i + at, p) for i, p in g.pins])
        for g in tail.groups
    )
    return Conversation(
        n_messages=head.n_messages + tail.n_messages,
        fixed=head.fixed + [i + at for i in tail.fixed],
        groups=groups,
        n_turns=t0 + tail.n_turns,
        chars=head.chars + tail.chars,
        text_chars=head.text_chars + tail.text_chars,
        media_parts=head.media_parts + tail.media_parts,
        media_tokens=head.media_tokens + tail.media_tokens,
        media_chars=head.media_chars + tail.media_chars,
        has_metadata=head.has_metadata or tail.has_metadata,
        memo=head.memo,
        pinned=head.pinned_groups + [g + len(head.groups) for g in tail.pinned_groups],
        tooled=head.tooled_groups + [g + len(head.groups) for g in tail.tooled_groups],
        cache_marked=head.cache_marked + [i + at for i in tail.cache_marked],
    )


class HistoryCache:
    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], Entry] = OrderedDict()
        # hash of a body's first bytes -> sessions whose record may match (collisions only
        # add candidates: a record is used only when the body starts with its bytes)
        self._by_head: dict[int, list[tuple[str, str]]] = {}
        self.hits = 0
        self.misses = 0
        self.spliced = 0  # bodies parsed from where the session's previous body left off

    def __len__(self) -> int:
        return len(self._entries)

    def resize(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._evict()

    def _records(self, raw: bytes, wire: Wire, tenant: str | None) -> Iterator[Reuse]:
        """The records of the tenant's sessions whose bodies began like `raw` (candidates
        only: a record applies when raw starts with its prefix). Never another tenant's:
        a parse is only ever reused by the caller whose body it was."""
        if len(raw) >= SPLICE_MIN_BYTES and tenant is not None:
            for key in self._by_head.get(hash(raw[:_HEAD])) or ():
                e = self._entries.get(key)
                if (e is not None and key[0] == tenant and e.wire is wire
                        and e.reuse is not None):
                    yield e.reuse

    def loads(self, raw: bytes, wire: Wire, tenant: str | None
              ) -> tuple[Any, splice.Splice | None]:
        """orjson.loads(raw), reusing the parse of one of the tenant's sessions' previous
        bodies when raw starts with that body's bytes up to its last item; (payload, the
        splice used or None). Raises orjson.JSONDecodeError like orjson.loads."""
        for r in self._records(raw, wire, tenant):
            payload = splice.loads(raw, r.rec, r.payload)
            if payload is not None:
                self.spliced += 1
                return payload, r.rec
        return orjson.loads(raw), None

    def unmarked_from(self, raw: bytes, wire: Wire, tenant: str | None) -> int:
        """Where a search of `raw` for splice.MARKERS has to start: past the prefix of a
        tenant's session's record that raw starts with and that holds none (else 0)."""
        for r in self._records(raw, wire, tenant):
            start = splice.unmarked_from(raw, r.rec)
            if start:
                return start
        return 0

    def remember(self, key: tuple[str, str], raw: bytes, payload: Any, items: list[Any],
                 src: splice.Splice | None, scan: bool = True, spans: bool = False) -> None:
        """After a request: note where its last item starts in `raw`, so the session's
        next body can be spliced there (scanning only the new items when this one was);
        `scan`: also note whether that prefix is free of splice.MARKERS; `spans`: and
        where its items are (see splice.make)."""
        e = self._entries.get(key)
        if e is None or (e.reuse is not None and e.reuse.payload is payload):
            return  # the session is gone, or this request's record is made
        # A newer request of the session owns the entry (concurrent requests: under load
        # there always is one). A record matches any body starting with its bytes, so
        # ours still serves the session unless the entry holds one reaching as far.
        newer = e.items is not items
        if newer and (len(raw) < SPLICE_MIN_BYTES or not isinstance(payload, dict)
                      or e.wire.items(payload) is not items
                      or (e.reuse is not None and _reaches(e.reuse.rec, raw, items))):
            return
        rec = None
        if len(raw) >= SPLICE_MIN_BYTES and isinstance(payload, dict):
            rec = splice.make(raw, e.wire.items_key, payload, src, scan, spans)
        if newer and (rec is None or (e.reuse is not None
                                      and len(e.reuse.rec.prefix) >= len(rec.prefix))):
            return
        old = len(e.reuse.rec.prefix) if e.reuse is not None else 0
        # no record of its own: drop the inherited one too (it holds an older parse)
        e.reuse = Reuse(rec, payload) if rec is not None else None
        grown = (len(rec.prefix) if rec is not None else 0) - old
        e.size += grown
        self.bytes += grown
        if rec is None:
            return
        head = hash(raw[:_HEAD])
        keys = self._by_head.get(head)
        if keys is None:
            if len(self._by_head) > 2 * self.max_entries:  # heads of sessions long gone
                self._by_head = {h: [k for k in ks if k in self._entries]
                                 for h, ks in self._by_head.items()}
                self._by_head = {h: ks for h, ks in self._by_head.items() if ks}
            keys = self._by_head[head] = []
        if key in keys:
            keys.remove(key)
        keys.insert(0, key)
        del keys[_PER_HEAD:]
        self._evict()

    def parse(
        self, key: tuple[str, str], wire: Wire, items: list[Any], rules: Any, size: int,
        prefix: str, min_score: float, context: tuple[str, ...] = (),
    ) -> View:
        """Parse `items`, reusing the session's previous request where it still holds.
        `context`: the client's opening-context prefixes, read by the parse of the
        history's start and by a piece after a head that holds no group (all fixed: the
        opening may go on into the piece); after a group the opening has ended."""
        start = last_turn_start(wire, items)
        old = self._entries.get(key)
        prev = old if old is not None and old.rules is rules and old.wire is wire else None
        known = _known(prev, items, start)
        try:
            if prev is not None and known and start is not None:
                mid = wire.parse(items[prev.start:start], prefix, min_score,
                                 () if prev.head.groups else context)
                head = join(prev.head, mid, prev.start)
                self.hits += 1
            elif start is not None:
                head = wire.parse(items[:start], prefix, min_score, context)
                prev, known = None, 0
                self.misses += 1
            else:
                return View(wire.parse(items, prefix, min_score, context))
            conv = join(head, wire.parse(items[start:], prefix, min_score,
                                         () if head.groups else context), start)
        except (ValueError, Unplannable):
            # a piece that does not parse alone (or bad metadata: the full parse names
            # the right index); the full parse decides
            return View(wire.parse(items, prefix, min_score, context))
        # what the entry keeps alive: the parsed items and the head's per-message
        # bookkeeping (measured: about 3x the request's bytes in all, soak.py)
        entry = Entry(rules, wire, items, head, start, 3 * size + 384 * len(items))
        if prev is not None:  # turns whose first message is unchanged stay archived
            entry.archived_upto = min(prev.archived_upto, known)
        if old is not None and old.reuse is not None and old.wire is wire:
            # a record stays valid for the bodies it matches: keep it until this
            # request's own is made (concurrent requests of a session need one)
            entry.reuse = old.reuse
            entry.size += len(old.reuse.rec.prefix)
        self._put(key, entry)
        return View(conv, known, prev, entry)

    def _put(self, key: tuple[str, str], entry: Entry) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        if entry.size > self.max_bytes or not self.max_entries:
            return
        self._entries[key] = entry
        self.bytes += entry.size
        self._evict()

    def _evict(self) -> None:
        while self._entries and (
            self.bytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.size


def tool_results(view: View | None, wire: Wire, items: list[Any],
                 off: frozenset[str] = frozenset()) -> list[ToolResult]:
    """wire.tool_results(items), the scan resumed where the session's previous request
    left it: its results and tool names up to its last turn start, unchanged in `items`
    (`view.known`), are taken as they are; checkpointed at this request's last turn
    start for the next one. `off`: MEMGATE_SHORTCUTS_OFF (toolscan: the whole scan)."""
    entry = view.entry if view is not None else None
    if view is None or entry is None or "toolscan" in off:
        return wire.tool_results(items)
    prev = view.prev
    start, out, names = 0, [], {}
    if prev is not None and prev.tools is not None and prev.start <= view.known:
        start, out, names = prev.start, list(prev.tools[0]), dict(prev.tools[1])
    if start <= entry.start:
        out += wire.tool_results(items[:entry.start], start, names)
        entry.tools = (tuple(out), dict(names))
        start = entry.start
    out += wire.tool_results(items, start, names)
    return out


def _reaches(rec: splice.Splice, raw: bytes, items: list[Any]) -> bool:
    """Does `rec` splice `raw` as far as a record made from `raw` would (up to its last
    item), or further?"""
    return rec.count >= len(items) - 1 and raw.startswith(rec.prefix)


def _known(prev: Entry | None, items: list[Any], start: int | None) -> int:
    """How many leading items are unchanged since `prev` (0 = nothing reusable)."""
    if prev is None or start is None or start < prev.start:
        return 0
    old, start = prev.items, prev.start
    if items[:start] != old[:start]:  # one pass over the history: most of it is here
        return 0
    n = len(old)
    return n if n <= len(items) and items[start:n] == old[start:] else start
