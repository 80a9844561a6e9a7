"""One request from bytes to decision: parse, plan, build the forwarded body.

Shared by the server handler and `memgate evict`, so the CLI explains exactly
what the gateway would forward. Works for every wire format. No I/O, no logging.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from gateway.config.rules import Rules
from gateway.config.schema import CarryRules, CompactRules
from gateway.decide.history import HistoryCache, View, tool_results
from gateway.decide.splice import Splice, spans_of
from gateway.errors import BadRequest, OverBudget
from gateway.measure.conversation import (
    META_KEY,
    BadMetadata,
    Conversation,
    Group,
    Unplannable,
    read_metadata,
)
from gateway.measure.tokens import TokenCounter, Tokenizers
from gateway.policy import Limits, Plan, PlanRules, plan
from gateway.policy.carry import Fold, Snapshot, render_note
from gateway.policy.carry.snapshot import DEFAULT_NOTE
from gateway.policy.compact import MARK, ToolResult, archive_id, compact_text, eligible, with_text
from gateway.policy.fill import forward_order
from gateway.policy.plan import fits_unplanned
from gateway.wire.base import Wire
from gateway.wire.jsonbytes import Span
from gateway.wire.openai_chat import OPENAI_CHAT

# the most of a malformed-metadata reason logged or answered (it can quote a client's key)
REASON_CHARS = 200
# text of a history not counted yet (a new turn; all of a cold history) that is counted
# before the plan to tell whether all of it fits (~0.5 ms of counting at most)
EXACT_CHARS = 16_384


@dataclass(slots=True)
class Decision:
    raw: bytes
    payload: Any
    wire: Wire
    mode: str
    model: str | None
    counter: TokenCounter
    forward: bytes  # `counter` counts text x tokens.approx_factor on an approx wire
    conv: Conversation | None = None
    plan: Plan | None = None
    skip_reason: str | None = None
    budget_tokens: int | None = None
    cache_marker_dropped: bool = False
    cache_marker_moved: bool = False
    snapshot: Snapshot | None = None
    note: str | None = None
    recalled: list[str] = field(default_factory=list)
    _items: list[Any] | None = None
    _overhead: int | None = None
    view: View | None = None  # what the session's history cache gave this request
    _msg_tokens: list[int] | None = None  # per message, -1 = not counted yet
    spliced_from: Splice | None = None  # the session's earlier body this one was parsed from
    bad_metadata: str | None = None  # why a memgate block was ignored (logged metadata=invalid)
    # compact_tools: per item, the (path, new text) of its compacted tool results, and
    # the item's tokens with them (the planner counts these instead)
    compacted: dict[int, list[tuple[Any, str]]] = field(default_factory=dict)
    compact_tokens: dict[int, int] = field(default_factory=dict)
    archived: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (item, original)
    noted: bool = False  # the carry note was built (d.note: it, or None if there is none)

    @property
    def messages(self) -> list[Any]:
        """The history list eviction works on (`messages`, or Responses `input`)."""
        if self._items is None:
            items = self.wire.items(self.payload) if isinstance(self.payload, dict) else None
            self._items = items if items is not None else []
        return self._items

    def message_tokens(self, i: int) -> int:
        counts = self._msg_tokens
        if counts is None:
            counts = self._msg_tokens = [-1] * len(self.messages)
        n = counts[i]
        if n < 0:
            n = counts[i] = self.wire.item_tokens(self.messages[i], self.counter)
        return n

    def planned_tokens(self, i: int) -> int:
        """Item i's tokens as forwarded: compacted, or as the client sent it."""
        n = self.compact_tokens.get(i)
        return self.message_tokens(i) if n is None else n

    def compacted_kept(self) -> tuple[int, int]:
        """(kept items with a compacted tool result, the tokens that saved)."""
        if not self.compacted or self.plan is None:
            return 0, 0
        kept = [i for i in self.plan.kept if i in self.compact_tokens]
        return len(kept), sum(self.message_tokens(i) - self.compact_tokens[i] for i in kept)

    def overhead_tokens(self) -> int:
        if self._overhead is None:
            self._overhead = (self.wire.overhead_tokens(self.payload, self.counter)
                              if isinstance(self.payload, dict) else 0)
        return self._overhead

    def placement(self) -> tuple[list[int], tuple[int, ...], int | None]:
        """(the kept items that stay where they are, ascending; the recalled ones, which
        move after them; the current turn's first item, which they go before). With no
        current turn nothing is asked, so nothing moves."""
        assert self.plan is not None
        current = current_turn_start(self.conv)
        moved = self.plan.recalled if current is not None else ()
        back = frozenset(moved)
        return [i for i in self.plan.kept if i not in back], moved, current

    def forwarded(self) -> list[int]:
        """The kept items in the order they are forwarded (recalled history moved after
        the stable part, before the current turn)."""
        stable, moved, current = self.placement()
        return forward_order(stable, moved, current) if moved and current is not None else stable

    def unchanged(self, reason: str) -> Decision:
        """This request as the client sent it: measured, not planned (`reason`: why)."""
        return replace(self, forward=self.raw, plan=None, skip_reason=reason, note=None,
                       snapshot=None, recalled=[], compacted={}, compact_tokens={},
                       archived={}, cache_marker_dropped=False, cache_marker_moved=False)

    def kept_tokens(self) -> int:
        """Estimated tokens of the request with only the plan's kept messages (and the
        carry note, when one is forwarded)."""
        assert self.plan is not None
        note = _note_cost(self)[0] if self.note is not None else 0
        return (self.overhead_tokens() + note
                + sum(self.planned_tokens(i) for i in self.plan.kept))

    def uncounted_chars(self) -> int:
        """Characters of the messages whose tokens the session's cache does not hold
        (an upper bound of what counting the whole history still has to tokenize)."""
        if self.conv is None:
            return 0
        known = self.view.known if self.view is not None else 0
        return sum(self.conv.text_chars[known:])  # media payloads are never tokenized

    async def count_off_loop(self, indices: list[int], executor: Executor | None = None) -> None:
        """Count these messages in a worker thread of `executor` (tiktoken releases the
        GIL): a cold megabyte history is not tokenized on the event loop."""
        items = self.messages
        if self._msg_tokens is None:
            self._msg_tokens = [-1] * len(items)
        todo = [i for i in indices if self._msg_tokens[i] < 0]
        if not todo:
            return
        # a private, uncached counter: confined to the worker thread
        wire, plain = self.wire, self.counter.private()
        batch = [items[i] for i in todo]
        counts = await asyncio.get_running_loop().run_in_executor(
            executor, lambda: [wire.item_tokens(m, plain) for m in batch])
        for i, n in zip(todo, counts):
            self._msg_tokens[i] = n

    def hist_chars(self) -> int:
        if self.conv is not None:
            return self.conv.total_chars
        return sum(self.wire.item_chars(m) for m in self.messages)

    def est_tokens(self) -> int:
        """The estimate for the whole request (counts cached per message content)."""
        return self.overhead_tokens() + self.all_message_tokens() if self.parsed_items() else 0

    def parsed_items(self) -> bool:
        """Is the history a non-empty list of objects (what counting needs)?"""
        msgs = self.messages
        if self.conv is not None:  # the parser checked every item
            return bool(msgs)
        return bool(msgs) and all(isinstance(m, dict) for m in msgs)

    def all_message_tokens(self) -> int:
        counts = self._msg_tokens
        if counts is None or min(counts, default=0) < 0:  # count what is missing first
            counts = self._inherit_counts()
            for i in [i for i, n in enumerate(counts) if n < 0]:
                self.message_tokens(i)
        return sum(counts)

    def _inherit_counts(self) -> list[int]:
        """This request's counts, with the unchanged items' gaps filled from the
        session's previous request: it may have counted them since this one started
        (concurrent requests of a session: each counts what its plan skipped)."""
        counts = self._msg_tokens
        if counts is None:
            counts = self._msg_tokens = [-1] * len(self.messages)
        view = self.view
        prev = view.prev if view is not None else None
        if (prev is not None and view is not None and 0 < view.known <= len(prev.tokens)
                and prev.token_key is self.counter):
            known, theirs = view.known, prev.tokens
            counts[:known] = [n if n >= 0 else m for n, m in zip(counts[:known], theirs)]
        return counts


def budget_tokens(rules: Rules, payload: dict[str, Any], model: str | None) -> int | None:
    b = rules.memory.budget
    if b.max_tokens != "auto":
        return b.max_tokens
    window = rules.model_info(model).context_window
    reserve = (
        payload.get("max_completion_tokens")
        or payload.get("max_output_tokens")
        or payload.get("max_tokens")
    )
    if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
        reserve = b.reserve_output_tokens
    return max(1, int((window - reserve) * b.safety_ratio))


def plan_rules(rules: Rules, max_tokens: int | None) -> PlanRules:
    hit: PlanRules | None = rules.memo.get(("plan_rules", max_tokens))
    if hit is not None:
        return hit
    m = rules.memory
    hit = PlanRules(
        limits=Limits(
            max_tokens=max_tokens,
            max_chars=m.budget.max_chars,
            max_messages=m.budget.max_messages,
            max_turns=m.budget.max_turns,
        ),
        order=tuple(s for s in m.eviction.order if s != "compact_tools"),  # see _compact
        keep_pinned=m.eviction.keep_pinned,
        max_pinned=m.eviction.max_pinned,
        drop_unit=m.eviction.drop_unit,
        min_score=m.markers.min_score,
        low_water=m.eviction.low_water,
        recall_share=m.eviction.recall_share,
        shortcuts_off=rules.shortcuts_off,
    )
    rules.remember(("plan_rules", max_tokens), hit)
    return hit


def decide(
    raw: bytes, payload: Any, rules: Rules, tokenizers: Tokenizers, wire: Wire = OPENAI_CHAT,
    recalled: list[str] | None = None, history: HistoryCache | None = None,
    key: tuple[str, str] | None = None, default_model: str | None = None,
    archive_in: str | None = None, spliced: Splice | None = None,
) -> Decision:
    """Plan one request; raises BadRequest / OverBudget for the client.

    With a `history` cache and the session's `key`, only what the session appended
    since its previous request is parsed, counted and folded. `default_model` is the
    model of a body that names none (an Azure deployment route names it in the path).
    `archive_in`: the tenant whose store will archive the originals of compacted tool
    results (their markers then name the archive ids). `spliced`: the session's record
    `raw` was parsed with (history.loads), whose item spans a cut reuses."""
    model = payload.get("model") if isinstance(payload, dict) else None
    model = model if isinstance(model, str) else default_model
    counter = tokenizers.get(rules.model_info(model).encoding)
    if wire.approx_tokens:
        counter = counter.scaled(rules.approx_token_factor)
    d = Decision(
        raw=raw, payload=payload, wire=wire, mode=rules.memory.mode, model=model,
        counter=counter, forward=raw,
        spliced_from=spliced,
    )
    if payload is None:
        d.skip_reason = "invalid_json"
        return d
    try:
        return _plan_into(d, rules, wire, recalled, history, key, archive_in)
    except orjson.JSONEncodeError:
        # nested deeper than orjson writes (255..1024 levels): counting cannot read it,
        # the client's bytes go as they came
        return Decision(raw=raw, payload=payload, wire=wire, mode=d.mode, model=model,
                        counter=counter, forward=raw,
                        skip_reason="nested_too_deep", _items=[], _overhead=0,
                        spliced_from=spliced)


def _plan_into(
    d: Decision, rules: Rules, wire: Wire, recalled: list[str] | None,
    history: HistoryCache | None, key: tuple[str, str] | None, archive_in: str | None = None,
) -> Decision:
    """`decide` once the body is known to be JSON: parse, plan, build the forward."""
    raw, payload, model = d.raw, d.payload, d.model
    if not isinstance(payload, dict):
        d.skip_reason = "not_an_object"
        return d
    items = wire.items(payload)
    if items is None:
        d.skip_reason = "no_messages"
        return d
    markers = rules.memory.markers
    d.budget_tokens = budget_tokens(rules, payload, model)
    # before the parse: with server-side state a result may answer a call the server
    # holds, which is no pairing error (and nothing client-side to evict)
    d.skip_reason = wire.skip_reason(payload)
    try:
        if d.skip_reason is not None:  # never planned: the session's cache saves nothing
            d.conv = wire.parse_continuation(items, markers.system_prefix, markers.min_score)
        elif history is not None and key is not None:
            d.view = history.parse(key, wire, items, rules, len(raw), markers.system_prefix,
                                   markers.min_score)
            d.conv = d.view.conv
            _reuse_tokens(d)
        else:
            d.conv = wire.parse(items, markers.system_prefix, markers.min_score)
    except Unplannable as exc:
        d.skip_reason = exc.reason
        return d
    except BadMetadata as exc:
        # only eviction on may refuse a request, and only if told to: the kill switch
        # never breaks a call
        reason = str(exc)[:REASON_CHARS]
        if d.mode == "on" and markers.on_bad_metadata == "reject":
            raise BadRequest(reason) from None
        d.bad_metadata = reason
        try:
            d.conv = wire.parse(_without_bad_metadata(items), markers.system_prefix,
                                markers.min_score)
        except Unplannable as unplannable:
            d.skip_reason = unplannable.reason
            return d
        d.conv.has_metadata = True  # the bad blocks are cut out of the forward too
    d.conv.outside_chars = wire.fixed_chars(payload)
    d.conv.current = _input_began(d.conv, wire, items)
    if d.mode != "off" and d.skip_reason is None:
        prules = plan_rules(rules, d.budget_tokens)
        overhead = d.overhead_tokens() if d.budget_tokens is not None else 0
        counted_by = d.counter  # one per encoding and factor; not the session `key`
        text_of = _text_of(wire, items)
        note_room = _note_room(d, rules, items, recalled) if d.mode == "on" else None
        bound = _bytes_bound(raw, d)
        exact = _exact_tokens(d, rules, prules.limits.max_tokens, overhead, bound)
        if exact is not None:
            bound = min(bound, exact)
        todo, spare = (_compactable(d, rules) if "compact_tools" in rules.memory.eviction.order
                       and not fits_unplanned(d.conv, prules.limits, bound) else ({}, {}))
        # with tool results to compact, this plan only tells whether the history is cut
        # (the stages under the whole budget): it is planned again either way, so the
        # stable part's second pass and the fill are not run for it
        probe = bool(todo or spare)
        d.plan = plan(d.conv, prules, d.message_tokens, overhead_tokens=overhead,
                      tokens_upper_bound=bound, tokens_key=counted_by,
                      text_of=None if probe else text_of, reserve=None if probe else note_room,
                      tokens_exact=exact)
        # over budget with nothing to drop: an agent loop's one long current turn
        if probe and (d.plan.dropped or d.plan.over_budget):
            client_conv = d.conv
            for _ in range(2):
                compacted = _compact(d, rules, todo, archive_in)
                counts = d.planned_tokens if compacted else d.message_tokens
                d.plan = plan(d.conv, prules, counts, overhead_tokens=overhead,
                              tokens_key=counted_by, text_of=text_of, reserve=note_room)
                # keep_recent holds the newest results whole, but not at the price of
                # their turn: those the plan dropped are compacted too, and planned again
                lost = {i: rs for i, rs in spare.items() if not _holds(d.plan.kept, i)}
                if not lost:
                    break
                # (an item's older results first, as in `todo`: these are the newest)
                todo = {**todo, **{i: todo.get(i, []) + rs for i, rs in lost.items()}}
                spare = {}
                d.conv, d.compacted, d.compact_tokens, d.archived = client_conv, {}, {}, {}
        if d.noted and not d.plan.dropped:  # the fill brought back all the stages dropped
            d.noted, d.note, d.snapshot, d.recalled = False, None, None, []
        if d.mode == "on" and (d.plan.dropped or recalled) and (
                d.note is not None if d.noted else _carry_note(d, rules, items, recalled)):
            # the note is counted into the budget: plan again unless it fits the slack
            # the cut left (the fill left the note room when it ran: it fits, unless the
            # stable part alone leaves too little)
            assert d.note is not None
            narrower = _minus_note(prules, d)
            if not _fits(d.plan, narrower.limits):
                d.plan = plan(d.conv, narrower, d.planned_tokens, overhead_tokens=overhead,
                              tokens_key=counted_by, text_of=text_of)
        if (
            d.mode == "on"
            and d.plan.over_budget
            and rules.memory.eviction.on_over_budget == "reject"
        ):
            raise OverBudget(
                "the system prompt, pinned messages and the current turn alone exceed the "
                f"gateway's history budget (max_tokens={d.budget_tokens}, "
                f"max_chars={rules.memory.budget.max_chars}, "
                f"max_messages={rules.memory.budget.max_messages}); shorten the current turn"
            )
    if d.plan is not None and d.plan.dropped:
        # the parse lists the marked messages: not a look at every dropped one
        kept = d.plan.kept
        d.cache_marker_dropped = wire.cache_markers and any(
            not _holds(kept, i) for i in d.conv.cache_marked)
    if d.mode == "on" and d.plan is not None and (d.plan.dropped or d.note or d.compacted):
        marker_at, ttl = None, None
        if d.cache_marker_dropped and rules.memory.eviction.move_cache_marker:
            marker_at = _end_of_stable_prefix(d.conv, d.plan)
            ttl = _moved_ttl(d, marker_at) if marker_at is not None else None
            if ttl is None:
                marker_at = None
            d.cache_marker_moved = marker_at is not None
        stable, moved, before = d.placement()
        _forward(d, wire.build_body(raw, payload, stable, marker_at, d.note, before,
                                    d.conv.has_metadata,
                                    {i: d.compacted[i] for i in d.plan.kept if i in d.compacted},
                                    moved, _known_spans(d, rules), marker_ttl=ttl or "5m"))
    elif d.conv.has_metadata:
        # gateway metadata is ours: upstreams never see it, whatever the mode
        _forward(d, wire.build_body(raw, payload, list(range(len(items))),
                                    spans=_known_spans(d, rules)))
    return d


def _known_spans(d: Decision, rules: Rules) -> list[Span] | None:
    """Where the items are in the body, when the session's record it was spliced with
    says where the resent ones are (only the new ones are scanned); None: the body is
    scanned for them (MEMGATE_SHORTCUTS_OFF=spans, or no record with spans)."""
    src = d.spliced_from
    if src is None or src.key != d.wire.items_key or "spans" in rules.shortcuts_off:
        return None
    return spans_of(d.raw, src, d.messages)


def _without_bad_metadata(items: list[Any]) -> list[Any]:
    """The items with each malformed memgate block left out (the message is then pinned
    by its text prefix alone); the body forwarded is still made from `items`."""
    out = list(items)
    for i, m in enumerate(items):
        if isinstance(m, dict) and META_KEY in m:
            try:
                read_metadata(m[META_KEY], "")
            except BadMetadata:
                out[i] = {k: v for k, v in m.items() if k != META_KEY}
    return out


def _compactable(d: Decision, rules: Rules
                 ) -> tuple[dict[int, list[ToolResult]], dict[int, list[ToolResult]]]:
    """The tool results compact_tools may shorten, per item; and those only keep_recent
    holds whole (the model has answered them), which may be if whole they cannot fit."""
    conv = d.conv
    assert conv is not None
    crules = rules.memory.eviction.compact
    pins = frozenset(i for g in conv.pinned_groups for i, _ in conv.groups[g].pins)
    items, role = d.messages, d.wire.item_role
    # the results the model is to act on now: after its last item, in the current turn
    # (one a later user message follows is history, as an answered one is)
    unread = next((i + 1 for i in range(len(items) - 1, -1, -1)
                   if role(items[i]) == "assistant"), 0)
    unread = max(unread, current_turn_start(conv) or 0)
    results = tool_results(d.view, d.wire, items, rules.shortcuts_off)  # resumed per session
    todo: dict[int, list[ToolResult]] = {}
    for r in eligible(results, crules, pins, unread):
        todo.setdefault(r.index, []).append(r)
    spare: dict[int, list[ToolResult]] = {}
    if crules.keep_recent:
        for r in eligible(results[-crules.keep_recent:], replace(crules, keep_recent=0),
                          pins, unread):
            spare.setdefault(r.index, []).append(r)
    return todo, spare


def _compact(d: Decision, rules: Rules, todo: dict[int, list[ToolResult]],
             archive_in: str | None) -> bool:
    """The compact_tools stage, run when the plan had to drop (or could not fit): every
    result of `todo` (_compactable) compacted (each a function of its text, the rules and
    the archiving tenant), the conversation's sizes and the planner's counts made those of
    the compacted items; True if any was. An original the store would cut (over
    max_chars_per_record) is not archived: the marker says so."""
    conv = d.conv
    assert conv is not None
    crules = rules.memory.eviction.compact
    items, room = d.messages, rules.store.max_chars_per_record
    # the planner's memo (checkpoints, fill index, stable part) for compacted histories
    # is their own, shared along the session like the client's: the same results compact
    # the same way each request
    shared: _Compacted = conv.memo.setdefault(("compacted",), _Compacted())
    resume = "toolscan" not in rules.shortcuts_off  # else every item and group made anew
    done, shared.items = shared.items if resume else {}, {}
    shorter: dict[int, int] = {}  # item -> characters of text its results lost
    chars, text_chars = list(conv.chars), list(conv.text_chars)
    for i, results in todo.items():
        rs = [(r, archive_id(archive_in, r.text) if archive_in and len(r.text) <= room
               else None) for r in results]
        item, key = items[i], tuple((r.path, aid) for r, aid in rs)
        hit = done.get(id(item))
        if (hit is None or hit.item is not item or hit.key != key or hit.rules is not crules
                or hit.counter is not d.counter):
            hit = _compact_item(d, item, key, rs, crules)
        shared.items[id(item)] = hit
        if hit.subs:
            d.compacted[i] = list(hit.subs)
            d.compact_tokens[i], chars[i] = hit.tokens, hit.chars
            shorter[i] = hit.lost
            text_chars[i] -= hit.lost  # only a result's text changed: the text it lost
            for aid, original in hit.archived:
                d.archived[aid] = (i, original)
    if not d.compacted:
        return False
    made, shared.groups = shared.groups if resume else {}, {}
    groups = []
    for g in conv.groups:
        if not any(i in d.compacted for i in g.indices):
            groups.append(g)
            continue
        # a new group where a size changed (the session's cached ones keep their sums);
        # the weights stay the client's, so stepped-cut checkpoints do not move. A group's
        # chars are the text the model reads (the max_chars budget)
        cut = tuple(shorter.get(i, 0) for i in g.indices)
        was = made.get(id(g))
        if was is not None and was[0] is g and was[1] == cut:
            new = was[2]  # the same object as last request: the planner's memos hold
        else:
            new = replace(g, chars=g.chars - sum(cut), tokens=-1, tokens_key=None)
        shared.groups[id(g)] = (g, cut, new)
        groups.append(new)
    d.conv = replace(conv, groups=groups, chars=chars, text_chars=text_chars,
                     memo=shared.memo)
    return True


@dataclass(slots=True)
class _Compacted:
    """What a session's compacted histories share from request to request: the planner's
    memo, and each compacted group made (id of the client's group -> (that group, the
    characters each of its items lost, the group made)), so that a history compacted as
    before is made of the same group objects, whose memos then hold (the fill's index,
    the stable part, the checkpoints: each resumed only while its groups are the same
    objects). Only the current request's groups are kept."""

    memo: dict[Any, Any] = field(default_factory=dict)
    groups: dict[int, tuple[Group, tuple[int, ...], Group]] = field(default_factory=dict)
    items: dict[int, _CompactedItem] = field(default_factory=dict)  # id of the client's item


@dataclass(frozen=True, slots=True)
class _CompactedItem:
    """One item's eligible results compacted: a function of the item, which of its
    results are eligible (their paths, archive ids), the rules and the counter, kept
    along the session so that an item compacted before is not compacted, copied and
    counted again on every request."""

    item: Any
    key: tuple[tuple[tuple[str | int, ...], str | None], ...]
    rules: CompactRules
    counter: TokenCounter
    subs: tuple[tuple[tuple[str | int, ...], str], ...]  # (path, compacted text)
    tokens: int  # the item's, compacted
    chars: int
    lost: int  # characters of text its results lost
    archived: tuple[tuple[str, str], ...]  # (archive id, original)


def _compact_item(d: Decision, item: Any, key: Any, results: list[tuple[ToolResult, str | None]],
                  crules: CompactRules) -> _CompactedItem:
    subs, archived, lost = [], [], 0
    for r, aid in results:
        text = compact_text(r.text, crules, aid)
        if text is not None:
            subs.append((r.path, text))
            lost += len(r.text) - len(text)
            if aid is not None and MARK in text:  # excerpted, not only minified
                archived.append((aid, r.text))
    tokens = chars = 0
    if subs:
        new = item
        for path, text in subs:
            new = with_text(new, path, text)
        tokens, chars = d.wire.item_tokens(new, d.counter), d.wire.item_chars(new)
    return _CompactedItem(item, key, crules, d.counter, tuple(subs), tokens, chars, lost,
                          tuple(archived))


def _forward(d: Decision, body: bytes | None) -> None:
    """Forward the rewritten body; a body that could not be read to rewrite it (valid
    JSON always can) goes unchanged, logged evict=skipped, nothing dropped or carried."""
    if body is not None:
        d.forward = body
        return
    d.skip_reason = "unscannable"
    d.plan, d.note, d.snapshot = None, None, None
    d.cache_marker_dropped = d.cache_marker_moved = False


def _reuse_tokens(d: Decision) -> None:
    """Start from the previous request's counts of the unchanged items; share this
    request's counts with the next one."""
    view = d.view
    assert view is not None
    n = len(d.messages)
    token_key = d.counter  # one per encoding and factor (Tokenizers, scaled)
    prev = view.prev
    if prev is not None and prev.token_key is token_key and view.known:
        d._msg_tokens = prev.tokens[: view.known] + [-1] * (n - view.known)
    else:
        d._msg_tokens = [-1] * n
    if view.entry is not None:
        view.entry.tokens = d._msg_tokens
        view.entry.token_key = token_key


def _note_room(
    d: Decision, rules: Rules, items: list[Any], recalled: list[str] | None
) -> Callable[[], tuple[int, int, int]]:
    """What the carry note takes of the budget (tokens, chars, messages), for the planner
    to ask once its stages have dropped history: the note is built then (from the whole
    history and the records recalled, not from what was dropped), so the fill leaves it
    room and the plan does not run again for it (it did on most cut requests: the fill
    leaves no slack). The stable part is planned under the budget without the note, so
    the note's length does not move the cut."""
    def room() -> tuple[int, int, int]:
        if not d.noted:
            _carry_note(d, rules, items, recalled, dropped=True)
        return _note_cost(d) if d.note is not None else (0, 0, 0)
    return room


def _note_cost(d: Decision) -> tuple[int, int, int]:
    """The carry note's tokens, chars and messages, as the budget counts them."""
    assert d.note is not None
    return d.counter.count_pieces((d.note, 4)), len(d.note), 1


def _carry_note(
    d: Decision, rules: Rules, items: list[Any], recalled: list[str] | None,
    dropped: bool | None = None,
) -> bool:
    """Build the session's snapshot and the note that carries it (with any recalled
    records); True if there is a note. `dropped`: whether history is dropped (by default
    what the plan says)."""
    carry, patterns = rules.memory.carry, rules.memory.carry_patterns
    if d.conv is None:
        return False
    d.noted = True
    if dropped is None:
        dropped = d.plan is not None and bool(d.plan.dropped)
    if carry.enabled and patterns is not None and dropped:
        d.snapshot = _fold(d, items, patterns, carry).snapshot(carry, d.conv.groups[-1].turn,
                                                        skipped=carry.log_skipped)
    template = patterns.note if patterns is not None else DEFAULT_NOTE
    d.recalled = list(recalled or [])
    d.note = render_note(d.snapshot, template, carry.max_note_chars, d.recalled)
    return d.note is not None


def _fold(d: Decision, items: list[Any], patterns: Any, carry: CarryRules) -> Fold:
    """The carry-over fold over every grouped message, resumed from the session's
    previous request when its history is unchanged up to where that fold stopped;
    checkpointed at this request's last turn start for the next one."""
    assert d.conv is not None
    view, wire = d.view, d.wire
    fold, start = Fold(patterns), 0
    prev = view.prev if view is not None else None
    if (prev is not None and prev.fold is not None and prev.fold.p is patterns
            and view is not None and view.known >= prev.start):
        # taken over, not copied: this request's entry replaces the previous one (a
        # concurrent request of the session finds none and folds from the start)
        fold, start, prev.fold = prev.fold, prev.start, None
    entry = view.entry if view is not None else None
    pause = entry.start if entry is not None and entry.start >= start else None
    turn_of: dict[int, int] = {}
    for g in reversed(d.conv.groups):  # groups are in index order: only the new ones
        if g.indices[-1] < start:
            break
        for i in g.indices:
            if i >= start:
                turn_of[i] = g.turn
    for i in sorted(turn_of):
        if pause is not None and i >= pause:
            assert entry is not None
            fold.prune(carry, turn_of[i])  # what this request's snapshot and later ones need
            entry.fold, pause = fold.copy(), None
        fold.add_text(turn_of[i], wire.item_role(items[i]), wire.item_text(items[i]))
    if pause is not None and entry is not None:
        entry.fold = fold  # nothing more is folded into it here: the snapshot only reads
    return fold


def _minus_note(prules: PlanRules, d: Decision) -> PlanRules:
    lim = prules.limits
    tokens, chars, messages = _note_cost(d)
    return replace(prules, limits=Limits(
        max_tokens=None if lim.max_tokens is None else max(1, lim.max_tokens - tokens),
        max_chars=None if lim.max_chars is None else max(1, lim.max_chars - chars),
        max_messages=None if lim.max_messages is None else max(1, lim.max_messages - messages),
        max_turns=lim.max_turns,
    ))


def _text_of(wire: Wire, items: list[Any]) -> Callable[[int], str]:
    """Message i's text, what the fill ranks dropped history by."""
    return lambda i: wire.item_text(items[i])


def _holds(ascending: Sequence[int], i: int) -> bool:
    k = bisect.bisect_left(ascending, i)
    return k < len(ascending) and ascending[k] == i


def _fits(p: Plan, lim: Limits) -> bool:
    return (
        (lim.max_tokens is None or (p.kept_tokens is not None and p.kept_tokens <= lim.max_tokens))
        and (lim.max_chars is None or p.kept_chars <= lim.max_chars)
        and (lim.max_messages is None or len(p.kept) <= lim.max_messages)
    )


def _input_began(conv: Conversation, wire: Wire, items: list[Any]) -> int | None:
    """The turn where the caller's input since the model's last reply began, when that is
    before the last turn: Anthropic merges consecutive user messages into one turn (a
    document, then the question about it; tool results, then a new instruction), and a
    model answers all of a chat's user messages since its reply. None: the last turn."""
    k = len(items)
    while k and wire.continues_input(items[k - 1]):
        k -= 1
    g = conv.group_of(k) if k < len(items) else None
    if g is None:
        return None
    turn = conv.groups[g].turn
    return turn if turn < conv.n_turns else None


def current_turn_start(conv: Conversation | None) -> int | None:
    """The first message of the current turn's groups (groups are in turn order; with
    the input begun in an earlier turn, from that turn on)."""
    if conv is None:
        return None
    start = None
    first = conv.first_current_turn
    for g in reversed(conv.groups):
        if g.turn < first:
            break
        start = g.indices[0] if start is None else min(start, g.indices[0])
    return start


def _end_of_stable_prefix(conv: Conversation, p: Plan) -> int | None:
    """The last kept item before the current turn: the end of what stays identical."""
    start = current_turn_start(conv)
    start = conv.n_messages if start is None else start
    recalled = set(p.recalled)
    before = [i for i in p.kept if i < start and i not in recalled]
    return before[-1] if before else None


def _moved_ttl(d: Decision, at: int) -> str | None:
    """The lifetime of the breakpoint move_cache_marker puts on item `at` (the end of the
    stable prefix): a dropped one's ("1h" if one was), where the order of the forwarded
    breakpoints stays valid (Anthropic refuses a 1-hour entry after a 5-minute one);
    None: no move (`at` is marked already, or neither lifetime fits there)."""
    assert d.plan is not None and d.conv is not None
    ttls = d.wire.cache_ttls
    items = d.messages
    if ttls(items[at]):
        return None
    order = d.forwarded()
    k = order.index(at)
    before = {t for i in order[:k] for t in ttls(items[i])}
    after = {t for i in order[k + 1:] for t in ttls(items[i])}
    kept = set(d.plan.kept)
    dropped = {t for i in d.conv.cache_marked if i not in kept for t in ttls(items[i])}
    if not before | after | dropped <= {"5m", "1h"}:  # a lifetime the rule does not know
        return None
    for ttl in (("1h", "5m") if "1h" in dropped else ("5m", "1h")):
        if (ttl == "1h" and "5m" not in before) or (ttl == "5m" and "1h" not in after):
            return ttl
    return None


def _exact_tokens(d: Decision, rules: Rules, limit: int | None, overhead: int, bound: int
                  ) -> int | None:
    """The request's tokens (the [mem] line's est_tokens, counted for it anyway), when the
    body's bytes do not bound them under the budget already and at most EXACT_CHARS of
    its text is not counted yet (a session's cache holds the rest): a history that fits
    is then not planned (MEMGATE_SHORTCUTS_OFF=exactfit: it is). `bound`: _bytes_bound.
    Not while the session's counts of the items it knows have gaps (a concurrent request
    of the session, a body decided again): those would be counted here too."""
    if (limit is None or bound <= limit or d.uncounted_chars() > EXACT_CHARS
            or "exactfit" in rules.shortcuts_off):
        return None
    counts, known = d._msg_tokens, d.view.known if d.view is not None else 0
    if known and (counts is None or min(counts[:known]) < 0):
        return None
    return overhead + d.all_message_tokens()


def _bytes_bound(raw: bytes, d: Decision) -> int:
    """Tokens never exceed the body's bytes (a token is at least one byte) scaled like
    the text counts, with each media part's payload bytes replaced by its cost."""
    conv = d.conv
    media_tokens, media_chars = (conv.media_tokens, conv.media_chars) if conv else (0, 0)
    return math.ceil((len(raw) - media_chars) * d.counter.factor) + media_tokens
