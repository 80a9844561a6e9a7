"""What every wire format provides to the planner and the handler."""

from __future__ import annotations

from typing import Any

import orjson

from ..conversation import Conversation
from ..errors import ApiFlavor
from ..tokens import TokenCounter

META_KEY = "memgate"


class Wire:
    """One API's request shape: where the history is, how to split and count it,
    and how to put a plan back into a body of the same API."""

    name = "base"
    flavor: ApiFlavor = "openai"
    items_key = "messages"
    approx_tokens = False  # counted with a stand-in tokenizer (logged tokenizer=approx)

    def items(self, payload: dict[str, Any]) -> list[Any] | None:
        v = payload.get(self.items_key)
        return v if isinstance(v, list) else None

    def skip_reason(self, payload: dict[str, Any]) -> str | None:
        """A reason not to evict a well-formed body (e.g. server-side state)."""
        return None

    def parse(self, items: list[Any], prefix: str, min_score: float) -> Conversation:
        raise NotImplementedError

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        raise NotImplementedError

    def item_chars(self, item: Any) -> int:
        raise NotImplementedError

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        raise NotImplementedError

    def fixed_chars(self, payload: dict[str, Any]) -> int:
        """Characters of the always-kept part outside the item list (e.g. `system`)."""
        return 0

    def has_cache_marker(self, item: Any) -> bool:
        """Does this item carry a provider prompt-cache breakpoint (`cache_control`)?"""
        return False

    def with_cache_marker(self, item: Any) -> Any:
        """A copy of `item` with a cache breakpoint on its last markable block."""
        return item

    def build_body(
        self, payload: dict[str, Any], kept: list[int], marker_at: int | None = None
    ) -> bytes:
        """The original body with only `kept` items, gateway metadata stripped;
        `marker_at` (an index in kept) gets a cache breakpoint moved onto it."""
        items = payload[self.items_key]
        out = []
        for i in kept:
            m = items[i]
            if isinstance(m, dict) and META_KEY in m:
                m = {k: v for k, v in m.items() if k != META_KEY}
            if i == marker_at:
                m = self.with_cache_marker(m)
            out.append(m)
        return orjson.dumps({**payload, self.items_key: out})


def json_text(value: Any) -> str:
    return orjson.dumps(value).decode("utf-8")
