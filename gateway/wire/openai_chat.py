"""OpenAI Chat Completions: `messages` <-> Conversation."""

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
    merge_into,
    message_pin,
    opens_with,
)
from gateway.measure.media import Piece
from gateway.measure.tokens import PER_MESSAGE, PER_NAME, REPLY_PRIMING, TokenCounter
from gateway.policy.carry import ToolCall
from gateway.policy.carry.calls import CALL_CHARS
from gateway.policy.compact import ToolResult
from gateway.wire.base import Wire, json_head

FIXED_ROLES = frozenset(("system", "developer"))


def parse(messages: list[Any], prefix: str, min_score: float,
          context: tuple[str, ...] = ()) -> Conversation:
    """Split a `messages` list into fixed part, turns and groups. User messages before
    the first reply that open with a `context` prefix are the client's context: fixed.

    Raises Unplannable for histories eviction must not touch (forwarded as is)
    and BadMetadata for malformed gateway metadata (chat.decide ignores or refuses it).
    """
    fixed: list[int] = []
    groups: list[Group] = []
    chars: list[int] = []
    text_chars: list[int] = []
    totals = Measure()
    has_meta = False
    turn = 0
    open_calls: dict[str, int] = {}  # tool_call_id -> group index, within the current turn
    opening = bool(context)  # before the first message that is neither fixed nor context
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Unplannable("message_not_object")
        role = m.get("role")
        if not isinstance(role, str):
            raise Unplannable("missing_role")
        content = m.get("content")
        if type(content) is str and not _beside_content(m):  # the common case, no walk
            n_chars = n_text = len(content)
            weight = 4 + approx_tokens(content)
            text: str | None = content
        else:
            n_chars = content_chars(content)
            text = first_text(content)
            ms = measure(message_pieces(m))
            n_text, weight = ms.chars, ms.weight
            totals.add_media(ms)
        chars.append(n_chars)
        text_chars.append(n_text)
        pin, meta_here = message_pin(m, "messages", i, text, prefix, min_score)
        has_meta = has_meta or meta_here

        if role in FIXED_ROLES:
            fixed.append(i)
            continue
        if opening:
            if role == "user" and opens_with(content, context):
                fixed.append(i)
                continue
            opening = False
        if role == "user":
            turn += 1
            open_calls = {}
            groups.append(Group([i], turn, True))
        elif role == "assistant":
            groups.append(Group([i], turn, False))
            calls = m.get("tool_calls")
            if calls:
                if not isinstance(calls, list):
                    raise Unplannable("tool_calls_not_list")
                for call in calls:
                    cid = call.get("id") if isinstance(call, dict) else None
                    if not isinstance(cid, str):
                        raise Unplannable("tool_call_without_id")
                    open_calls[cid] = len(groups) - 1
            elif m.get("function_call") is not None:
                open_calls["\0function"] = len(groups) - 1
        elif role in ("tool", "function"):
            key = m.get("tool_call_id") if role == "tool" else "\0function"
            g = open_calls.get(key) if isinstance(key, str) else None
            if g is None:
                raise Unplannable("unpaired_tool_result")
            if g != len(groups) - 1:
                merge_into(groups, g, open_calls)
            groups[-1].indices.append(i)
        else:
            raise Unplannable("unknown_role")
        grp = groups[-1]
        grp.chars += n_text
        grp.weight += weight
        if pin is not None:
            grp.pins.append((i, pin))
    return Conversation(
        n_messages=len(messages),
        fixed=fixed,
        groups=groups,
        n_turns=turn,
        chars=chars,
        text_chars=text_chars,
        media_parts=totals.media,
        media_tokens=totals.media_tokens,
        media_chars=totals.media_chars,
        has_metadata=has_meta,
    )


def _beside_content(m: dict[str, Any]) -> bool:
    """Does the model read more of this message than its content?"""
    return "tool_calls" in m or "function_call" in m or "name" in m


def part_pieces(part: Any) -> Iterator[Piece]:
    """One content part as the model reads it (shared by the Responses wire, whose
    input_* parts have the same media)."""
    if not isinstance(part, dict):
        yield from media.opaque(part)
        return
    text = part.get("text")
    if isinstance(text, str):  # text, input_text, output_text
        yield text
        return
    kind = part.get("type")
    if kind == "refusal":
        yield str(part.get("refusal") or "")
    elif kind == "image_url":
        img = part.get("image_url")
        if isinstance(img, dict):
            yield media.openai_image(img.get("url"), img.get("detail"))
        else:
            yield media.openai_image(img, None)
    elif kind in ("input_image", "computer_screenshot"):  # Responses
        yield media.openai_image(part.get("image_url"), part.get("detail"))
    elif kind == "input_audio":
        audio = part.get("input_audio")
        audio = audio if isinstance(audio, dict) else part  # Responses has no wrapper
        yield media.audio(audio.get("data"), audio.get("format"))
    elif kind in ("file", "input_file"):
        f = part.get("file")
        f = f if isinstance(f, dict) else part  # Responses has no wrapper
        if isinstance(f.get("filename"), str):
            yield f["filename"]
        yield media.file_data(f.get("file_data"))
    else:
        yield from media.opaque(part)


def content_pieces(content: Any) -> Iterator[Piece]:
    """A content as the model reads it: a string, parts, or (anything else) its JSON."""
    if content is None:
        return
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            yield from part_pieces(part)
    else:
        yield from media.opaque(content)


def called(call: Any) -> dict[str, Any] | None:
    """What a tool call calls: `function` {name, arguments}, or (a custom tool's
    freeform call) `custom` {name, input}."""
    fn = call.get("function", call.get("custom")) if isinstance(call, dict) else None
    return fn if isinstance(fn, dict) else None


def message_pieces(m: dict[str, Any]) -> Iterator[Piece]:
    """OpenAI's per-message accounting: 3 + role + content (+ name + 1) + tool calls."""
    yield PER_MESSAGE + 1
    yield from content_pieces(m.get("content"))
    name = m.get("name")
    if isinstance(name, str):
        yield name
        yield PER_NAME
    refusal = m.get("refusal")
    if isinstance(refusal, str):  # an assistant's refusal, beside a null content
        yield refusal
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = called(call)
            if fn is not None:
                yield PER_MESSAGE
                yield str(fn.get("name", ""))
                yield str(fn.get("arguments", fn.get("input", "")))
    fc = m.get("function_call")
    if isinstance(fc, dict):
        yield str(fc.get("name", ""))
        yield str(fc.get("arguments", ""))


def message_tokens(m: dict[str, Any], counter: TokenCounter) -> int:
    return counter.count_pieces(message_pieces(m))


def overhead_tokens(body: dict[str, Any], counter: TokenCounter) -> int:
    """Tokens every request pays besides its messages: reply priming and tool schemas."""
    n = REPLY_PRIMING
    tools = body.get("tools") or body.get("functions")
    if tools:
        n += counter.count(orjson.dumps(tools).decode("utf-8"))
    return n


class OpenAIChat(Wire):
    name = "openai_chat"
    flavor = "openai"
    items_key = "messages"
    stream_ends = (b"data: [DONE]",)

    def parse(self, items: list[Any], prefix: str, min_score: float,
              context: tuple[str, ...] = ()) -> Conversation:
        return parse(items, prefix, min_score, context)

    def tool_results(self, items: list[Any], start: int = 0,
                     names: dict[Any, str] | None = None) -> list[ToolResult]:
        names = {} if names is None else names
        out = []
        for i, m in enumerate(items[start:], start):
            if not isinstance(m, dict):
                continue
            for call in m.get("tool_calls") or () if m.get("role") == "assistant" else ():
                fn = called(call)
                if fn is not None and isinstance(fn.get("name"), str):
                    names[call.get("id")] = fn["name"]
            if m.get("role") == "tool" and isinstance(m.get("content"), str):
                out.append(ToolResult(i, ("content",), m["content"],
                                      names.get(m.get("tool_call_id"))))
        return out

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        return message_tokens(item, counter)

    def item_chars(self, item: Any) -> int:
        return content_chars(item.get("content")) if isinstance(item, dict) else 0

    def item_calls(self, item: Any) -> list[ToolCall]:
        # `arguments` is JSON text already; a custom tool's `input` is free text
        if not isinstance(item, dict) or item.get("role") != "assistant":
            return []
        calls = item.get("tool_calls")
        fns = [called(c) for c in calls] if isinstance(calls, list) else []
        if isinstance(item.get("function_call"), dict):
            fns.append(item["function_call"])
        out = []
        for fn in fns:
            if fn is None or not isinstance(fn.get("name"), str):
                continue
            args = fn.get("arguments")
            out.append(ToolCall(fn["name"], args[:CALL_CHARS] if isinstance(args, str)
                                else json_head(fn.get("input"), CALL_CHARS)))
        return out

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        return overhead_tokens(payload, counter)


OPENAI_CHAT = OpenAIChat()
