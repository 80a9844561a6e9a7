"""The compact_tools stage applied to one request: old, bulky tool results shortened in
place before the planner runs again.

Which results may be compacted (not pinned, not unread by the model, not among the newest
keep_recent), and the conversation's sizes and the planner's counts made those of the
compacted items. Each item compacted, and each group made, is kept along the session so
that a history compacted as before is not compacted, copied and counted again. No I/O,
no logging.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gateway.config.schema import CompactRules, Rules
from gateway.decide.decision import Decision, current_turn_start
from gateway.decide.history import tool_results
from gateway.measure.conversation import Group
from gateway.measure.tokens import TokenCounter
from gateway.policy.compact import MARK, ToolResult, archive_id, compact_text, eligible, with_text


def results_of(d: Decision, rules: Rules) -> list[ToolResult]:
    """The request's tool results (the scan resumed along the session)."""
    return tool_results(d.view, d.wire, d.messages, rules.shortcuts_off)


def compactable(d: Decision, rules: Rules, results: list[ToolResult]
                ) -> tuple[dict[int, list[ToolResult]], dict[int, list[ToolResult]]]:
    """The tool results compact_tools may shorten, per item; and those only keep_recent
    holds whole (the model has answered them), which may be if whole they cannot fit.
    `results`: results_of the request."""
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
    todo: dict[int, list[ToolResult]] = {}
    for r in eligible(results, crules, pins, unread):
        todo.setdefault(r.index, []).append(r)
    spare: dict[int, list[ToolResult]] = {}
    if crules.keep_recent:
        for r in eligible(results[-crules.keep_recent:], replace(crules, keep_recent=0),
                          pins, unread):
            spare.setdefault(r.index, []).append(r)
    return todo, spare


def excerpted(d: Decision, rules: Rules, results: list[ToolResult]
              ) -> dict[int, list[ToolResult]]:
    """memory.retrieve.excerpt_min_chars: every tool result at least that long (not
    pinned, not of an excluded tool), read or not, cut or not, per item: excerpted on
    every request from the first that carries it, its handle in the marker, so that its
    bytes stay the same along the session (a prompt cache keeps them) and the model
    reads the whole of it only when it asks. Empty when the request may not carry the
    retrieval tool. `results`: results_of the request."""
    least = rules.memory.retrieve.excerpt_min_chars
    conv = d.conv
    if d.handles_in is None or least is None or conv is None:
        return {}
    excluded = rules.memory.eviction.compact.exclude_tools
    pins = frozenset(i for g in conv.pinned_groups for i, _ in conv.groups[g].pins)
    out: dict[int, list[ToolResult]] = {}
    for r in results:
        if (len(r.text) >= least and r.index not in pins
                and (r.tool is None or r.tool not in excluded)):
            out.setdefault(r.index, []).append(r)
    return out


def compact(d: Decision, rules: Rules, todo: dict[int, list[ToolResult]],
            archive_in: str | None) -> bool:
    """The compact_tools stage, run when the plan had to drop (or could not fit): every
    result of `todo` (compactable) compacted (each a function of its text, the rules and
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
    # conv.chars stay the client's: hist_chars measures what was sent, in every mode;
    # what the budget counts (text_chars, the groups' chars and tokens) is compacted
    text_chars = list(conv.text_chars)
    d.compact_chars = {}
    # memory.retrieve: every excerpt names a handle the retrieval tool takes (the
    # archive id when the store archives it, else one of the tenant and session)
    tool = rules.memory.retrieve.tool_name if d.handles_in is not None else None
    for i, results in todo.items():
        # the ids the markers name are a function of these and the item's texts: hashed
        # only when the item is compacted anew
        item = items[i]
        key = (tuple(r.path for r in results), archive_in, d.handles_in, tool, room)
        hit = done.get(id(item))
        if (hit is None or hit.item is not item or hit.key != key or hit.rules is not crules
                or hit.counter is not d.counter):
            hit = _compact_item(d, item, key, [_handles(r, archive_in, room, d.handles_in)
                                               for r in results], crules, tool)
        shared.items[id(item)] = hit
        if hit.subs:
            d.compacted[i] = list(hit.subs)
            d.compact_tokens[i], d.compact_chars[i] = hit.tokens, hit.chars
            shorter[i] = hit.lost
            text_chars[i] -= hit.lost  # only a result's text changed: the text it lost
            for aid, original, stored in hit.archived:
                if stored:
                    d.archived[aid] = (i, original)
                if tool is not None:
                    d.retrievable[aid] = original
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
    d.conv = replace(conv, groups=groups, text_chars=text_chars, memo=shared.memo)
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
    # the results' paths, the archiving tenant, the handles' tenant and session, the
    # retrieval tool's name, the store's record size: what the ids and markers depend on
    key: tuple[Any, ...]
    rules: CompactRules
    counter: TokenCounter
    subs: tuple[tuple[tuple[str | int, ...], str], ...]  # (path, compacted text)
    tokens: int  # the item's, compacted
    chars: int  # the item's, compacted, by hist_chars' measure (sent_chars)
    lost: int  # characters of text its results lost
    # (archive id or handle, original, whether the store archives it)
    archived: tuple[tuple[str, str, bool], ...]


def _handles(r: ToolResult, archive_in: str | None, room: int, handles_in: str | None
             ) -> tuple[ToolResult, str | None, bool]:
    """(the result, the id its marker names, whether the store archives its original)."""
    stored = archive_in is not None and len(r.text) <= room
    if stored:
        assert archive_in is not None
        return r, archive_id(archive_in, r.text), True
    return r, archive_id(handles_in, r.text) if handles_in is not None else None, False


def _compact_item(d: Decision, item: Any, key: Any,
                  results: list[tuple[ToolResult, str | None, bool]], crules: CompactRules,
                  tool: str | None) -> _CompactedItem:
    subs, archived, lost = [], [], 0
    for r, aid, stored in results:
        text = compact_text(r.text, crules, aid, tool)
        if text is not None:
            subs.append((r.path, text))
            lost += len(r.text) - len(text)
            if aid is not None and MARK in text:  # excerpted, not only minified
                archived.append((aid, r.text, stored))
    tokens = chars = 0
    if subs:
        new = item
        for path, text in subs:
            new = with_text(new, path, text)
        tokens, chars = d.wire.item_tokens(new, d.counter), d.wire.item_chars(new)
    return _CompactedItem(item, key, crules, d.counter, tuple(subs), tokens, chars, lost,
                          tuple(archived))
