"""Anthropic Messages: `messages` (content blocks) <-> Conversation.

`system` is top-level and always kept. A turn starts at a user message that
carries no `tool_result`; a user message with tool results belongs to the group
of the assistant message whose `tool_use` ids they answer, so a call and its
results are never split. `thinking` blocks live inside their assistant message
and go with it. There is no offline Claude tokenizer: counts use the configured
encoding times a correction factor and are logged `tokenizer=approx`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

from gateway.measure import media
from gateway.measure.conversation import (
    Conversation,
    Group,
    Measure,
    Unplannable,
    approx_tokens,
    content_chars,
    first_text,
    measure,
    message_pin,
    opens_with,
    str_fields,
)
from gateway.measure.media import Piece
from gateway.measure.tokens import PER_MESSAGE, REPLY_PRIMING, TokenCounter
from gateway.policy.carry import ToolCall
from gateway.policy.carry.calls import CALL_CHARS
from gateway.policy.compact import ToolResult
from gateway.wire.base import Wire, json_head, json_text
from gateway.wire.jsonbytes import Edit, elements, members

ROLES = ("user", "assistant")


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return []


def tool_ids(content: Any, block_type: str, key: str) -> list[str]:
    return [
        b[key] for b in _blocks(content)
        if b.get("type") == block_type and isinstance(b.get(key), str)
    ]


def parse(messages: list[Any], prefix: str, min_score: float,
          context: tuple[str, ...] = ()) -> Conversation:
    """Split `messages` into turns and groups (the system part is outside the list). User
    messages before the first reply that open with a `context` prefix are the client's
    context: fixed."""
    fixed: list[int] = []
    groups: list[Group] = []
    chars: list[int] = []
    text_chars: list[int] = []
    totals = Measure()
    has_meta = False
    turn = 0
    open_uses: set[str] = set()  # tool_use ids of the last assistant message
    marked: list[int] = []
    opening = bool(context)  # before the first message that is not context
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
        if type(content) is str:
            n_text, weight = n_chars, 4 + approx_tokens(content)
        else:
            ms = measure(message_pieces(m))
            n_text, weight = ms.chars, ms.weight
            totals.add_media(ms)
        text_chars.append(n_text)
        blocks = _blocks(content)
        if any("cache_control" in b for b in blocks):
            marked.append(i)
        pin, meta_here = message_pin(m, "messages", i, first_text(content), prefix,
                                     min_score)
        has_meta = has_meta or meta_here
        if opening:
            if role == "user" and opens_with(content, context) and not tool_ids(
                    content, "tool_result", "tool_use_id"):
                fixed.append(i)
                continue
            opening = False
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
        grp.chars += n_text
        grp.weight += weight
        if pin is not None:
            grp.pins.append((i, pin))
    return Conversation(
        n_messages=len(messages), fixed=fixed, groups=groups, n_turns=turn, chars=chars,
        text_chars=text_chars, media_parts=totals.media, media_tokens=totals.media_tokens,
        media_chars=totals.media_chars, has_metadata=has_meta, cache_marked=marked,
    )


def block_pieces(b: dict[str, Any]) -> Iterator[Piece]:
    """One content block as the model reads it (README: "How items are counted")."""
    kind = b.get("type")
    if kind == "text":
        # a text block's `citations` are not counted: Anthropic bills neither the
        # cited_text of a reply nor, sent back, of a later request
        yield str(b.get("text", ""))
    elif kind == "thinking":
        yield str(b.get("thinking", ""))  # the signature is opaque and not read as text
    elif kind == "redacted_thinking":
        yield len(str(b.get("data", ""))) // 4  # encrypted: estimated, never tokenized
    elif kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
        yield from str_fields(b, "name", "server_name")
        yield json_text(b.get("input", {}))
    elif kind in ("tool_result", "mcp_tool_result"):
        yield from content_pieces(b.get("content"))
    elif kind == "image":
        yield media.anthropic_image(b.get("source"))
    elif kind == "document":
        yield from document_pieces(b)
    elif kind == "search_result":
        yield from str_fields(b, "source", "title")
        yield from content_pieces(b.get("content"))
    elif kind == "web_search_tool_result":
        yield from _search_results(b.get("content"))
    elif kind == "web_fetch_tool_result":
        inner = b.get("content")
        if isinstance(inner, dict):
            yield from str_fields(inner, "url", "retrieved_at", "error_code")
            doc = inner.get("content")
            if isinstance(doc, dict):
                yield from block_pieces(doc)
    else:
        yield from media.opaque(b)


def _search_results(content: Any) -> Iterator[Piece]:
    if isinstance(content, dict):  # web_search_tool_result_error
        yield from str_fields(content, "error_code")
        return
    for r in _blocks(content):
        yield from str_fields(r, "title", "url", "page_age")
        # the page text the model reads, encrypted: ~4 characters a token, not tokenized
        yield len(str(r.get("encrypted_content", ""))) // 4


def document_pieces(b: dict[str, Any]) -> Iterator[Piece]:
    """A document: its title and context, then its source (text by its text, a PDF
    by its pages, content blocks as blocks)."""
    yield from str_fields(b, "title", "context")
    if isinstance(b.get("citations"), dict):
        yield json_text(b["citations"])
    source = b.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if not isinstance(source, dict) or kind not in ("text", "content", "base64"):
        yield media.pdf(None)  # url, file: the bytes are elsewhere
    elif kind == "text":
        yield str(source.get("data", ""))
    elif kind == "content":
        yield from content_pieces(source.get("content"))
    else:
        yield media.pdf(source.get("data"))


def content_pieces(content: Any) -> Iterator[Piece]:
    if isinstance(content, str):
        yield content
    else:
        for b in _blocks(content):
            yield from block_pieces(b)


def message_pieces(m: dict[str, Any]) -> Iterator[Piece]:
    yield PER_MESSAGE + 1
    yield from content_pieces(m.get("content"))


def content_tokens(content: Any, counter: TokenCounter) -> int:
    return counter.count_pieces(content_pieces(content))


UNMARKABLE = frozenset(("thinking", "redacted_thinking"))
EPHEMERAL = {"type": "ephemeral"}
_EPHEMERAL = orjson.dumps(EPHEMERAL)


class AnthropicMessages(Wire):
    name = "anthropic_messages"
    flavor = "anthropic"
    items_key = "messages"
    approx_tokens = True
    cache_markers = True
    stream_ends = (b"event: message_stop",)

    def parse(self, items: list[Any], prefix: str, min_score: float,
              context: tuple[str, ...] = ()) -> Conversation:
        return parse(items, prefix, min_score, context)

    def starts_turn(self, item: Any) -> bool:
        return (isinstance(item, dict) and item.get("role") == "user"
                and not tool_ids(item.get("content"), "tool_result", "tool_use_id"))

    def continues_input(self, item: Any) -> bool:
        # tool results are user messages, which the API merges with those around them
        return isinstance(item, dict) and item.get("role") == "user"

    def tool_results(self, items: list[Any], start: int = 0,
                     names: dict[Any, str] | None = None) -> list[ToolResult]:
        # a tool_result's content: a string, or text blocks only (they become one string;
        # a block with an image, a cache breakpoint or anything else keeps it as it is)
        names = {} if names is None else names
        out = []
        for i, m in enumerate(items[start:], start):
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
        return counter.count_pieces(message_pieces(item))

    def item_chars(self, item: Any) -> int:
        return content_chars(item.get("content")) if isinstance(item, dict) else 0

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        n = REPLY_PRIMING + content_tokens(payload.get("system"), counter)
        if payload.get("tools"):
            n += counter.count(json_text(payload["tools"]))
        return n

    def fixed_chars(self, payload: dict[str, Any]) -> int:
        return measure(content_pieces(payload.get("system"))).chars

    def item_role(self, item: Any) -> str:
        role = item.get("role") if isinstance(item, dict) else None
        if role == "user" and tool_ids(item.get("content"), "tool_result", "tool_use_id"):
            return "tool"
        return role if role in ("user", "assistant") else "system"

    def item_calls(self, item: Any) -> list[ToolCall]:
        # tool_use blocks (server_tool_use, mcp_tool_use: the same shape), `input` an object
        if not isinstance(item, dict) or item.get("role") != "assistant":
            return []
        return [ToolCall(b["name"], json_head(b.get("input"), CALL_CHARS))
                for b in _blocks(item.get("content"))
                if str(b.get("type")).endswith("tool_use") and isinstance(b.get("name"), str)]

    def note_item(self, note: str) -> dict[str, Any]:
        # no system role inside messages: the note is a user message of its own, which
        # the API merges with the current turn's user message that follows it
        return {"role": "user", "content": [{"type": "text", "text": note}]}

    def has_cache_marker(self, item: Any) -> bool:
        return isinstance(item, dict) and any(
            "cache_control" in b for b in _blocks(item.get("content"))
        )

    def cache_ttls(self, item: Any) -> list[str]:
        if not isinstance(item, dict):
            return []
        out = []
        for b in _blocks(item.get("content")):
            if "cache_control" in b:
                c = b["cache_control"]
                ttl = c.get("ttl", "5m") if isinstance(c, dict) else None
                out.append(ttl if isinstance(ttl, str) else "?")
        return out

    def cache_marker_edits(self, b: bytes, at: int, item: Any, ttl: str = "5m") -> list[Edit]:
        # only the marked block's bytes change: a string content becomes one text block
        # around the client's string bytes, a block gets the key added (one the client
        # marked already keeps its own)
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, (str, list)):
            return []
        mark = _EPHEMERAL if ttl == "5m" else orjson.dumps({**EPHEMERAL, "ttl": ttl})
        c = [m for m in members(b, at) if m.name == "content"][-1]
        if isinstance(content, str):
            return [(c.value, c.end, b"".join((b'[{"type":"text","text":', b[c.value:c.end],
                                                b',"cache_control":', mark, b"}]")))]
        for j in range(len(content) - 1, -1, -1):
            block = content[j]
            if isinstance(block, dict) and block.get("type") not in UNMARKABLE:
                if "cache_control" in block:
                    return []
                start = elements(b, c.value, content)[j][0]
                fields = members(b, start, block)
                if fields:
                    return [(fields[-1].end, fields[-1].end, b',"cache_control":' + mark)]
                return [(start + 1, start + 1, b'"cache_control":' + mark)]
        return []


ANTHROPIC_MESSAGES = AnthropicMessages()
