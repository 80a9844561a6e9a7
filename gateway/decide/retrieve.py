"""What memgate's retrieval tool can give back for one request (memory.retrieve).

When a cut leaves something out and the request may carry the tool (`wire.retrieve_tool
.forbids`), every omission names a handle: a compacted tool result's marker its
`cmp-` handle (its original, from the client's own body), the carry note the `hist-`
handle of the turns the cut dropped. `resolve` answers a handle from the request in hand
(the client resends its history, so what was cut is here); a handle this request did not
make is not answered here (the caller may look in the tenant's and session's archive).
A request with tools of its own carries the tool from a session's first request; a chat
without tools from its first cut on, and then every later request of the session, so that
the cached prefix changes at most once. No I/O, no logging.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from gateway.config.schema import Rules
from gateway.decide.decision import Decision
from gateway.wire.retrieve_tool import forbids, tool_def


def may_retrieve(d: Decision, rules: Rules, key: tuple[str, str] | None) -> bool:
    """May this request carry the retrieval tool? Sets `d.retrieve_off` (why not) and,
    if it may, the tenant its handles are made for (`d.handles_in`)."""
    r = rules.memory.retrieve
    if not r.enabled or d.mode != "on" or not isinstance(d.payload, dict):
        return False
    why = forbids(d.wire, d.payload, r, d.model)
    if why is not None:
        d.retrieve_off = why
        return False
    d.handles_in = "\0".join(key) if key is not None else ""
    # counted with the tool schemas whenever it may come (an agent's requests carry it
    # from the first; a cut one always): the floor and est_sent_tokens hold it
    d.tool_tokens, d._overhead = _tool_tokens(d, rules), None
    return True


def _tool_tokens(d: Decision, rules: Rules) -> int:
    key = ("retrieve_tokens", d.wire.name, d.counter)
    hit: int | None = rules.memo.get(key)
    if hit is None:
        # as the wires count a tool list: its JSON (alone, or a client's list grown by it)
        hit = d.counter.count(f"[{tool_def(d.wire, rules.memory.retrieve).decode()}]")
        rules.remember(key, hit)
    return hit


def carries_tool(d: Decision) -> bool:
    """Does the forwarded request carry the tool? When it may and something is left
    out, when the client sends tools of its own, or when the session's earlier request
    carried it (remembered on its entry)."""
    if d.handles_in is None or d.plan is None:
        return False
    prev = d.view.prev if d.view is not None else None
    cut = bool(d.plan.dropped) or bool(d.compacted)
    # a request with tools of its own (an agent's) carries it from the session's first
    # request: added later it would change the cached prefix from the tools on
    agent = isinstance(d.payload, dict) and bool(d.payload.get("tools"))
    on = cut or agent or bool(prev is not None and prev.retrieve)
    if on and d.view is not None and d.view.entry is not None:
        d.view.entry.retrieve = True
    return on


def hist_handle(d: Decision) -> str | None:
    """The handle of the turns a cut drops: one per session (made from the tenant, the
    session and the history's first message), answered with whatever this request left
    out, so that the note naming it reads the same on every request."""
    if d.handles_in is None or d.conv is None or not d.conv.groups:
        return None
    first = d.wire.item_text(d.messages[d.conv.groups[0].indices[0]])
    digest = hashlib.sha256(f"{d.handles_in}\0{first}".encode("utf-8", "surrogatepass"))
    return "hist-" + digest.hexdigest()[:24]


def hist_line(d: Decision, tool: str) -> str | None:
    """The carry note's line naming the dropped turns' handle."""
    d.hist_handle = hist_handle(d)
    if d.hist_handle is None:
        return None
    return (f"- earlier turns were left out: call {tool} with handle \"{d.hist_handle}\" "
            "for their full text")


def dropped_items(d: Decision) -> list[int]:
    """The items the plan left out, ascending (not those brought back)."""
    if d.plan is None or not d.plan.dropped:
        return []
    kept = set(d.plan.kept)
    return [i for i, _ in d.plan.dropped if i not in kept]


def resolve(d: Decision, handle: str) -> str | None:
    """The full text behind `handle`, from this request (None: it made no such handle)."""
    if handle in d.retrievable:
        return d.retrievable[handle]
    if handle == d.hist_handle and d.hist_handle is not None:
        return render(d.wire, d.messages, dropped_items(d))
    return None


def render(wire: Any, items: list[Any], indices: list[int]) -> str:
    """Items as a transcript the model reads: role, text, and each tool call's name
    and arguments."""
    out = []
    for i in indices:
        item = items[i]
        text = wire.item_text(item)
        calls = "".join(f"\n[call {c.name}({c.arguments})]" for c in wire.item_calls(item))
        out.append(f"[{wire.item_role(item)}] {text}{calls}")
    return "\n\n".join(out)


# characters either side of a query's match that come back with it
AROUND = 300
MAX_TERMS = 16


def passages(text: str, query: str, around: int = AROUND) -> str:
    """The passages of `text` that hold the query's words (case-insensitive): each match
    with `around` characters either side, overlapping ones joined, in the text's order,
    a line between them saying how much was skipped. No match: a line saying so."""
    terms = list(dict.fromkeys(w for w in query.casefold().split() if w))[:MAX_TERMS]
    spans: list[tuple[int, int]] = []
    for t in terms:  # matched in the text itself: its offsets are the text's
        for m in re.finditer(re.escape(t), text, re.IGNORECASE):
            spans.append((max(0, m.start() - around), min(len(text), m.end() + around)))
    if not spans:
        return f"[memgate: no passage holds {query!r}; call again without a query for all]"
    spans.sort()
    merged = [spans[0]]
    for a, b in spans[1:]:
        if a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    out, pos = [], 0
    for a, b in merged:
        if a > pos:
            out.append(f"[memgate: {a - pos:,} characters skipped]")
        out.append(text[a:b])
        pos = b
    if pos < len(text):
        out.append(f"[memgate: {len(text) - pos:,} characters skipped]")
    return "\n".join(out)


def page(text: str, offset: int, limit: int, tool: str) -> str:
    """The part of `text` from `offset`, at most `limit` characters, and where the rest
    goes on."""
    offset = max(0, min(offset, len(text)))
    part = text[offset:offset + limit]
    rest = len(text) - offset - len(part)
    if rest <= 0:
        return part
    return (f"{part}\n[memgate: {rest:,} more characters; call {tool} again with "
            f"offset={offset + len(part)}]")
