"""Anthropic Messages: `messages` (content blocks) <-> Conversation.

`system` is top-level and always kept. A turn starts at a user message that
carries no `tool_result`; a user message with tool results belongs to the group
of the assistant message whose `tool_use` ids they answer, so a call and its
results are never split. `thinking` blocks live inside their assistant message
and go with it. There is no offline Claude tokenizer: counts use the configured
encoding times a correction factor and are logged `tokenizer=approx`.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..conversation import (
    Conversation,
    Group,
    Unplannable,
    approx_weight,
    content_chars,
    first_text,
    message_pin,
)
from ..jsonbytes import Edit, elements, members
from ..policy.compact import ToolResult
from ..tokens import PER_MEDIA_PART, PER_MESSAGE, REPLY_PRIMING, TokenCounter
from .base import Wire, json_text

ROLES = ("user", "assistant")


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return []


def tool_ids(content: Any, block_type: str, key: str) -> list[str]:
    return [
        b[key] for b in _blocks(content) if b.get("type") == block_type and isinstance(b.get(key), str)
    ]


def parse(messages: list[Any], prefix: str, min_score: float) -> Conversation:
    groups: list[Group] = []
    chars: list[int] = []
    media = 0
    has_meta = False
    turn = 0
    open_uses: set[str] = set()  # tool_use ids of the last assistant message
    marked: list[int] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Unplannable("message_not_object")
        role = m.get("role")
        if not isinstance(role, str):
            raise Unplannable("missing_role")
        if role not in ROLES:
            raise Unplannable("unknown_role")
        content = m.get("content")
        n_chars = content_chars(content)
        chars.append(n_chars)
        blocks = _blocks(content)
        media += sum(1 for b in blocks if b.get("type") in ("image", "document"))
        if any("cache_control" in b for b in blocks):
            marked.append(i)
        pin, meta_here = message_pin(m, "messages", i, first_text(content), prefix,
                                     min_score)
        has_meta = has_meta or meta_here
        if role == "user":
            results = tool_ids(content, "tool_result", "tool_use_id")
            if results:
                if not groups or groups[-1].is_user or not set(results) <= open_uses:
                    raise Unplannable("unpaired_tool_result")
                groups[-1].indices.append(i)
            else:
                turn += 1
                groups.append(Group([i], turn, True))
            open_uses = set()
        else:
            groups.append(Group([i], turn, False))
            open_uses = set(tool_ids(content, "tool_use", "id"))
        grp = groups[-1]
        grp.chars += n_chars
        grp.weight += approx_weight(content, n_chars)
        if pin is not None:
            grp.pins.append((i, pin))
    return Conversation(
        n_messages=len(messages), fixed=[], groups=groups, n_turns=turn, chars=chars,
        media_parts=media, has_metadata=has_meta, cache_marked=marked,
    )


def _block_tokens(b: dict[str, Any], counter: TokenCounter) -> int:
    kind = b.get("type")
    if kind == "text":
        return counter.count(str(b.get("text", "")))
    if kind == "thinking":
        return counter.count(str(b.get("thinking", "")))
    if kind == "redacted_thinking":
        return len(str(b.get("data", ""))) // 4
    if kind in ("tool_use", "server_tool_use"):
        return counter.count(str(b.get("name", ""))) + counter.count(json_text(b.get("input", {})))
    if kind == "tool_result":
        inner = b.get("content")
        if isinstance(inner, str):
            return counter.count(inner)
        return sum(_block_tokens(x, counter) for x in _blocks(inner))
    if kind in ("image", "document"):
        return PER_MEDIA_PART
    return counter.count(json_text(b))


def content_tokens(content: Any, counter: TokenCounter) -> int:
    if isinstance(content, str):
        return counter.count(content)
    return sum(_block_tokens(b, counter) for b in _blocks(content))


UNMARKABLE = frozenset(("thinking", "redacted_thinking"))
EPHEMERAL = {"type": "ephemeral"}
_EPHEMERAL = orjson.dumps(EPHEMERAL)


class AnthropicMessages(Wire):
    name = "anthropic_messages"
    flavor = "anthropic"
    items_key = "messages"
    approx_tokens = True
    cache_markers = True

    def parse(self, items: list[Any], prefix: str, min_score: float) -> Conversation:
        return parse(items, prefix, min_score)

    def starts_turn(self, item: Any) -> bool:
        return (isinstance(item, dict) and item.get("role") == "user"
                and not tool_ids(item.get("content"), "tool_result", "tool_use_id"))

    def tool_results(self, items: list[Any]) -> list[ToolResult]:
        # a tool_result's content: a string, or text blocks only (they become one string;
        # a block with an image, a cache breakpoint or anything else keeps it as it is)
        names: dict[Any, str] = {}
        out = []
        for i, m in enumerate(items):
            if not isinstance(m, dict):
                continue
            blocks = _blocks(m.get("content"))
            for b in blocks:
                if b.get("type") == "tool_use" and isinstance(b.get("name"), str):
                    names[b.get("id")] = b["name"]
            if m.get("role") != "user" or not isinstance(m.get("content"), list):
                continue
            for k, b in enumerate(m["content"]):
                if not isinstance(b, dict) or b.get("type") != "tool_result":
                    continue
                c = b.get("content")
                if isinstance(c, list) and c and all(
                        isinstance(t, dict) and t.keys() == {"type", "text"}
                        and t["type"] == "text" and isinstance(t["text"], str) for t in c):
                    c = "\n".join(t["text"] for t in c)
                if isinstance(c, str):
                    out.append(ToolResult(i, ("content", k, "content"), c,
                                          names.get(b.get("tool_use_id"))))
        return out

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        return PER_MESSAGE + 1 + content_tokens(item.get("content"), counter)

    def item_chars(self, item: Any) -> int:
        return content_chars(item.get("content")) if isinstance(item, dict) else 0

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        n = REPLY_PRIMING + content_tokens(payload.get("system"), counter)
        if payload.get("tools"):
            n += counter.count(json_text(payload["tools"]))
        return n

    def fixed_chars(self, payload: dict[str, Any]) -> int:
        return content_chars(payload.get("system"))

    def item_role(self, item: Any) -> str:
        role = item.get("role") if isinstance(item, dict) else None
        if role == "user" and tool_ids(item.get("content"), "tool_result", "tool_use_id"):
            return "tool"
        return role if role in ("user", "assistant") else "system"

    def note_item(self, note: str) -> dict[str, Any]:
        # no system role inside messages: the note is a user message of its own, which
        # the API merges with the current turn's user message that follows it
        return {"role": "user", "content": [{"type": "text", "text": note}]}

    def has_cache_marker(self, item: Any) -> bool:
        return isinstance(item, dict) and any(
            "cache_control" in b for b in _blocks(item.get("content"))
        )

    def cache_marker_edits(self, b: bytes, at: int, item: Any) -> list[Edit]:
        # only the marked block's bytes change: a string content becomes one text block
        # around the client's string bytes, a block gets the key added (or its value set)
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, (str, list)):
            return []
        c = [m for m in members(b, at) if m.name == "content"][-1]
        if isinstance(content, str):
            return [(c.value, c.end, b"".join((b'[{"type":"text","text":', b[c.value:c.end],
                                                b',"cache_control":', _EPHEMERAL, b"}]")))]
        for j in range(len(content) - 1, -1, -1):
            block = content[j]
            if isinstance(block, dict) and block.get("type") not in UNMARKABLE:
                start = elements(b, c.value, content)[j][0]
                fields = members(b, start, block)
                marks = [m for m in fields if m.name == "cache_control"]
                if marks:
                    return [(marks[-1].value, marks[-1].end, _EPHEMERAL)]
                if fields:
                    return [(fields[-1].end, fields[-1].end, b',"cache_control":' + _EPHEMERAL)]
                return [(start + 1, start + 1, b'"cache_control":' + _EPHEMERAL)]
        return []


ANTHROPIC_MESSAGES = AnthropicMessages()
