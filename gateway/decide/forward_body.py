"""The body forwarded for one decided request, made from the client's bytes.

Only the plan's kept items, the recalled ones moved after the stable prefix, the carry
note before the current turn, compacted tool results in place, a dropped cache
breakpoint moved to the end of the stable prefix, and the client's memgate metadata cut
out (gateway metadata never reaches an upstream, whatever the mode). The item spans of
the session's body this one was spliced from are reused: only new items are scanned.
No I/O, no logging.
"""

from __future__ import annotations

from typing import Any

from gateway.config.schema import Rules
from gateway.decide.decision import Decision, current_turn_start
from gateway.decide.splice import spans_of
from gateway.measure.conversation import Conversation
from gateway.policy import Plan
from gateway.wire.jsonbytes import Span, append_edit, apply
from gateway.wire.retrieve_tool import tool_def


def build_forward(d: Decision, rules: Rules, items: list[Any]) -> None:
    """Set `d.forward` to the body the decision forwards (`items`: the client's history
    list); left the client's bytes when nothing is dropped, noted, compacted or cut out."""
    assert d.conv is not None
    wire, raw, payload = d.wire, d.raw, d.payload
    tool = _tool(rules, wire) if d.retrieve is not None else None
    if (tool is not None and d.plan is not None and not d.conv.has_metadata
            and not (d.plan.dropped or d.note or d.compacted)):
        # nothing cut: the client's bytes with the retrieval tool appended, no item read
        try:
            d.forward = apply(raw, [append_edit(raw, payload, "tools", tool,
                                                _known_spans(d, rules))])
        except (IndexError, ValueError):
            _forward(d, None)
        return
    if d.mode == "on" and d.plan is not None and (d.plan.dropped or d.note or d.compacted
                                                  or tool is not None):
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
                                    moved, _known_spans(d, rules), marker_ttl=ttl or "5m",
                                    tool=tool))
    elif d.conv.has_metadata:
        # gateway metadata is ours: upstreams never see it, whatever the mode
        _forward(d, wire.build_body(raw, payload, list(range(len(items))),
                                    spans=_known_spans(d, rules)))


def _tool(rules: Rules, wire: Any) -> bytes:
    """The retrieval tool's definition for this wire, made once per config."""
    hit: bytes | None = rules.memo.get(("retrieve_tool", wire.name))
    if hit is None:
        hit = tool_def(wire, rules.memory.retrieve)
        rules.remember(("retrieve_tool", wire.name), hit)
    return hit


def _known_spans(d: Decision, rules: Rules) -> list[Span] | None:
    """Where the items are in the body, when the session's record it was spliced with
    says where the resent ones are (only the new ones are scanned); None: the body is
    scanned for them (MEMGATE_SHORTCUTS_OFF=spans, or no record with spans)."""
    src = d.spliced_from
    if src is None or src.key != d.wire.items_key or "spans" in rules.shortcuts_off:
        return None
    return spans_of(d.raw, src, d.messages)


def _forward(d: Decision, body: bytes | None) -> None:
    """Forward the rewritten body; a body that could not be read to rewrite it (valid
    JSON always can) goes unchanged, logged evict=skipped, nothing dropped or carried."""
    if body is not None:
        d.forward = body
        return
    d.skip_reason = "unscannable"
    d.plan, d.note, d.snapshot = None, None, None
    d.cache_marker_dropped = d.cache_marker_moved = False
    d.retrieve, d.retrievable, d.hist_handle = None, {}, None
    d.tool_tokens, d._overhead = 0, None


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
