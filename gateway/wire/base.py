"""What every wire format provides to the planner and the handler."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from gateway.errors import ApiFlavor
from gateway.measure.conversation import META_KEY, Conversation
from gateway.measure.tokens import TokenCounter
from gateway.policy.carry import ToolCall
from gateway.policy.compact import ToolResult
from gateway.wire.jsonbytes import (
    Edit,
    Span,
    append_edit,
    apply,
    cut,
    elements,
    members,
    value_span,
    ws,
)

__all__ = ["META_KEY", "Wire", "json_head", "json_text", "text_of"]


class Wire:
    """One API's request shape: where the history is, how to split and count it,
    and how to put a plan back into a body of the same API."""

    name = "base"
    flavor: ApiFlavor = "openai"
    items_key = "messages"
    approx_tokens = False  # counted with a stand-in tokenizer (logged tokenizer=approx)
    # items may carry provider prompt-cache breakpoints (the parse then lists them in
    # Conversation.cache_marked)
    cache_markers = False
    # the line that starts the last event of a complete stream (stream completion is
    # judged by it, not by when the client hung up)
    stream_ends: tuple[bytes, ...] = ()

    def items(self, payload: dict[str, Any]) -> list[Any] | None:
        v = payload.get(self.items_key)
        return v if isinstance(v, list) else None

    def skip_reason(self, payload: dict[str, Any]) -> str | None:
        """A reason not to evict a well-formed body (e.g. server-side state)."""
        return None

    def parse(self, items: list[Any], prefix: str, min_score: float,
              context: tuple[str, ...] = ()) -> Conversation:
        """The history's shape; `context`: the prefixes of the client's opening context
        (memory.context.prefixes), given only when `items` start the history."""
        raise NotImplementedError

    def parse_continuation(self, items: list[Any], prefix: str, min_score: float
                           ) -> Conversation:
        """Parse a body that `skip_reason` found continuing a history the server holds:
        its items may answer calls that are not among them."""
        return self.parse(items, prefix, min_score)

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        raise NotImplementedError

    def starts_turn(self, item: Any) -> bool:
        """Does this item open a turn (a user message)? The parser's state starts
        afresh there, which is what lets a growing history be parsed piecewise."""
        return isinstance(item, dict) and item.get("role") == "user"

    def continues_input(self, item: Any) -> bool:
        """Is this item the caller's (a user message, a wire's tool results sent as one)?
        The run of them that ends the list is the input since the model's last reply,
        all of it the current turn."""
        return self.starts_turn(item)

    def item_chars(self, item: Any) -> int:
        raise NotImplementedError

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        raise NotImplementedError

    def fixed_chars(self, payload: dict[str, Any]) -> int:
        """Characters of the always-kept part outside the item list (e.g. `system`)."""
        return 0

    def item_role(self, item: Any) -> str:
        """user | assistant | tool | system, as the carry-over reads a conversation."""
        role = item.get("role") if isinstance(item, dict) else None
        return role if role in ("user", "assistant", "tool") else "system"

    def item_text(self, item: Any) -> str:
        """The plain text of an item (text parts joined), for the carry-over."""
        content = item.get("content") if isinstance(item, dict) else None
        return text_of(content)

    def item_calls(self, item: Any) -> list[ToolCall]:
        """The tool calls an item makes, for the carry-over: each tool's name and the
        head of its arguments' JSON text (the first CALL_CHARS characters of it)."""
        return []

    def note_item(self, note: str) -> dict[str, Any]:
        """The carry-over note as an item of this API, placed before the current turn."""
        return {"role": "system", "content": note}

    def has_cache_marker(self, item: Any) -> bool:
        """Does this item carry a provider prompt-cache breakpoint (`cache_control`)?"""
        return False

    def cache_ttls(self, item: Any) -> list[str]:
        """The lifetimes of the item's prompt-cache breakpoints, in order ("5m", "1h")."""
        return []

    def cache_marker_edits(self, b: bytes, at: int, item: Any, ttl: str = "5m") -> list[Edit]:
        """The edits that put a cache breakpoint (living `ttl`) on the last markable block
        of `item`, whose bytes start at b[at] (none: nothing to mark, or it has one)."""
        return []

    def tool_results(self, items: list[Any], start: int = 0,
                     names: dict[Any, str] | None = None) -> list[ToolResult]:
        """The text results of tool calls in `items[start:]`, oldest first (what
        compaction may shorten); none on a wire without tool results. `names`: the tool
        names by call id of the calls before `start`, updated with those after it (a
        scan resumed where an earlier one stopped, history.tool_results)."""
        return []

    def listed(self, value: bytes) -> bytes | None:
        """When `items()` makes its list out of a value that is not one (a Responses
        `input` string): that list's bytes, from the value's (None: not a list here)."""
        return None

    def build_body(
        self, raw: bytes, payload: dict[str, Any], kept: list[int],
        marker_at: int | None = None, note: str | None = None, note_before: int | None = None,
        metadata: bool = True, texts: dict[int, list[tuple[Any, str]]] | None = None,
        moved: Sequence[int] = (), spans: list[Span] | None = None, marker_ttl: str = "5m",
        tool: bytes | None = None,
    ) -> bytes | None:
        """The client's body `raw` (parsed: `payload`) with only the `kept` items
        (ascending), the gateway metadata cut out of them (`metadata`: any item may hold
        some); `marker_at` (an index in kept) gets a cache breakpoint moved onto it
        (`marker_ttl` long);
        `moved` (recalled history, in this order) and then `note` go right before item
        `note_before` (the current turn), after the stable prefix; `texts` gives items a
        new string at a path inside them (a compacted tool result: only that value's
        bytes change). Made from the client's bytes: every other byte is the client's,
        a moved item's included. `spans`: where the items are in `raw`, when that is
        known (then the body is not scanned for them). `tool`: a tool definition
        appended to the body's tools (memgate's retrieval tool).
        None when the bytes cannot be read so (the caller forwards them unchanged)."""
        items = self.items(payload)
        if items is None:
            return None
        key = self.items_key
        try:
            if spans is not None:
                edits = self._item_edits(raw, spans, items, kept, marker_at, note,
                                         note_before, metadata, texts, moved, marker_ttl)
                if tool is not None:
                    edits.append(append_edit(raw, payload, "tools", tool, spans))
                return apply(raw, edits)
            top = members(raw, ws(raw, 0), payload, listed=key)
            m = [m for m in top if m.name == key][-1]  # the one orjson read
            if m.items is not None:
                edits = self._item_edits(raw, m.items, items, kept, marker_at, note,
                                         note_before, metadata, texts, moved, marker_ttl)
                if tool is not None:
                    edits.append(append_edit(raw, payload, "tools", tool, m.items))
                return apply(raw, edits)
            listed = self.listed(raw[m.value : m.end])
            if listed is None or tool is not None:  # (a one-item history is never cut)
                return None
            edits = self._item_edits(listed, elements(listed, 0, items), items, kept,
                                     marker_at, note, note_before, metadata, texts, moved,
                                     marker_ttl)
            return b"".join((raw[: m.value], apply(listed, edits), raw[m.end :]))
        except (IndexError, ValueError):  # orjson's decode error included
            return None

    def _item_edits(
        self, b: bytes, spans: list[Span], items: Any, kept: list[int],
        marker_at: int | None, note: str | None, note_before: int | None, metadata: bool,
        texts: dict[int, list[tuple[Any, str]]] | None = None, moved: Sequence[int] = (),
        marker_ttl: str = "5m",
    ) -> list[Edit]:
        if len(spans) != len(items):
            raise ValueError("items differ from their bytes")

        def own(i: int) -> list[Edit]:
            """The edits inside item i: its metadata cut out, new texts, a marker."""
            out: list[Edit] = []
            item = items[i]
            if metadata and isinstance(item, dict) and META_KEY in item:
                ms = members(b, spans[i][0])
                out += cut([(x.start, x.end) for x in ms],
                           [k for k, x in enumerate(ms) if x.name != META_KEY])
            for path, text in (texts or {}).get(i, ()):
                start, end = value_span(b, spans[i][0], item, path)
                out.append((start, end, orjson.dumps(text)))
            if i == marker_at:
                out += self.cache_marker_edits(b, spans[i][0], item, marker_ttl)
            return out

        edits = cut(spans, kept)  # the moved items go from where they were too
        for i in kept:
            edits += own(i)
        front = b"".join(_moved(b, spans[i], own(i)) + b"," for i in moved)
        if note is not None:
            front += orjson.dumps(self.note_item(note)) + b","
        if front and note_before in kept:
            start = spans[note_before][0]
            edits.append((start, start, front))
        return edits


def _moved(b: bytes, span: Span, edits: list[Edit]) -> bytes:
    """The bytes of the item at `span` with its own `edits` made (to go elsewhere)."""
    start, end = span
    return apply(b[start:end], [(x - start, y - start, new) for x, y, new in edits])


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif p.get("type") == "tool_result":
                    parts.append(text_of(p.get("content")))
        return "\n".join(parts)
    return ""


def json_text(value: Any) -> str:
    return orjson.dumps(value).decode("utf-8")


def json_head(value: Any, limit: int) -> str:
    """`json_text(value)[:limit]`, written out only that far: a tool call's 1 MB input
    costs a bounded copy. "" for a value JSON cannot spell or nested past Python's
    recursion limit."""
    out: list[str] = []
    room = limit

    def put(text: str) -> bool:
        nonlocal room
        out.append(text[:room])
        room -= len(out[-1])
        return room > 0

    def walk(v: Any) -> bool:  # False: the room is used up
        if isinstance(v, str):  # v[:room] escapes to at least `room` characters
            return put(orjson.dumps(v[:room]).decode("utf-8"))
        if isinstance(v, dict):
            if not put("{"):
                return False
            for k, (name, x) in enumerate(v.items()):
                if (k and not put(",")) or not walk(name) or not put(":") or not walk(x):
                    return False
            return put("}")
        if isinstance(v, list):
            if not put("["):
                return False
            for k, x in enumerate(v):
                if (k and not put(",")) or not walk(x):
                    return False
            return put("]")
        return put(orjson.dumps(v).decode("utf-8"))

    try:
        walk(value)
    except (orjson.JSONEncodeError, TypeError, RecursionError):  # deeper than decide plans
        return ""
    return "".join(out)
