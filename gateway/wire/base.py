"""What every wire format provides to the planner and the handler."""

from __future__ import annotations

from typing import Any

import orjson

from ..conversation import META_KEY, Conversation
from ..errors import ApiFlavor
from ..tokens import TokenCounter

__all__ = ["META_KEY", "Wire", "json_text", "text_of"]


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

    def parse(self, items: list[Any], prefix: str, min_score: float) -> Conversation:
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

    def note_item(self, note: str) -> dict[str, Any]:
        """The carry-over note as an item of this API, placed before the current turn."""
        return {"role": "system", "content": note}

    def has_cache_marker(self, item: Any) -> bool:
        """Does this item carry a provider prompt-cache breakpoint (`cache_control`)?"""
        return False

    def with_cache_marker(self, item: Any) -> Any:
        """A copy of `item` with a cache breakpoint on its last markable block."""
        return item

    def build_body(
        self, payload: dict[str, Any], kept: list[int], marker_at: int | None = None,
        note: str | None = None, note_before: int | None = None,
    ) -> bytes:
        """The original body with only `kept` items, gateway metadata stripped;
        `marker_at` (an index in kept) gets a cache breakpoint moved onto it; `note`
        goes right before item `note_before` (the current turn), after the stable prefix."""
        items = payload[self.items_key]
        out = []
        for i in kept:
            if note is not None and i == note_before:
                out.append(self.note_item(note))
            m = items[i]
            if isinstance(m, dict) and META_KEY in m:
                m = {k: v for k, v in m.items() if k != META_KEY}
            if i == marker_at:
                m = self.with_cache_marker(m)
            out.append(m)
        return orjson.dumps({**payload, self.items_key: out})


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
