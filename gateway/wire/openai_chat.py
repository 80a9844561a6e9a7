"""OpenAI Chat Completions: `messages` <-> Conversation."""

from __future__ import annotations

from typing import Any

import orjson

from ..conversation import (
    Conversation,
    Group,
    Unplannable,
    approx_tokens,
    approx_weight,
    content_chars,
    first_text,
    merge_into,
    message_pin,
)
from ..policy.compact import ToolResult
from ..tokens import PER_MEDIA_PART, PER_MESSAGE, PER_NAME, REPLY_PRIMING, TokenCounter
from .base import Wire

FIXED_ROLES = frozenset(("system", "developer"))


def parse(messages: list[Any], prefix: str, min_score: float) -> Conversation:
    """Split a `messages` list into fixed part, turns and groups.

    Raises Unplannable for histories eviction must not touch (forwarded as is)
    and BadMetadata for malformed gateway metadata (a 400 for the client).
    """
    fixed: list[int] = []
    groups: list[Group] = []
    chars: list[int] = []
    media = 0
    has_meta = False
    turn = 0
    open_calls: dict[str, int] = {}  # tool_call_id -> group index, within the current turn
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise Unplannable("message_not_object")
        role = m.get("role")
        if not isinstance(role, str):
            raise Unplannable("missing_role")
        content = m.get("content")
        if type(content) is str:
            n_chars = len(content)
            text = content
        else:
            n_chars = content_chars(content)
            text = first_text(content)
            if isinstance(content, list):
                media += sum(
                    1 for p in content
                    if not (isinstance(p, dict) and isinstance(p.get("text"), str))
                )
        chars.append(n_chars)
        pin, meta_here = message_pin(m, "messages", i, text, prefix, min_score)
        has_meta = has_meta or meta_here

        if role in FIXED_ROLES:
            fixed.append(i)
            continue
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
        grp.chars += n_chars
        grp.weight += approx_weight(content, n_chars)
        calls = m.get("tool_calls")
        if calls:
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    grp.weight += approx_tokens(fn["arguments"]) + 3
        if pin is not None:
            grp.pins.append((i, pin))
    return Conversation(
        n_messages=len(messages),
        fixed=fixed,
        groups=groups,
        n_turns=turn,
        chars=chars,
        media_parts=media,
        has_metadata=has_meta,
    )


def content_tokens(content: Any, counter: TokenCounter) -> int:
    """Tokens of a content: a string, text parts (media parts estimated), or JSON."""
    if content is None:
        return 0
    if isinstance(content, str):
        return counter.count(content)
    if isinstance(content, list):
        n = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                n += counter.count(part["text"])
            else:
                n += PER_MEDIA_PART
        return n
    return counter.count(orjson.dumps(content).decode("utf-8"))


def message_tokens(m: dict[str, Any], counter: TokenCounter) -> int:
    """OpenAI's per-message accounting: 3 + role + content (+ name + 1) + tool calls."""
    n = PER_MESSAGE + 1 + content_tokens(m.get("content"), counter)
    name = m.get("name")
    if isinstance(name, str):
        n += counter.count(name) + PER_NAME
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                n += PER_MESSAGE
                n += counter.count(str(fn.get("name", "")))
                n += counter.count(str(fn.get("arguments", "")))
    fc = m.get("function_call")
    if isinstance(fc, dict):
        n += counter.count(str(fc.get("name", ""))) + counter.count(str(fc.get("arguments", "")))
    return n


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

    def parse(self, items: list[Any], prefix: str, min_score: float) -> Conversation:
        return parse(items, prefix, min_score)

    def tool_results(self, items: list[Any]) -> list[ToolResult]:
        names: dict[Any, str] = {}
        out = []
        for i, m in enumerate(items):
            if not isinstance(m, dict):
                continue
            for call in m.get("tool_calls") or () if m.get("role") == "assistant" else ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    names[call.get("id")] = fn["name"]
            if m.get("role") == "tool" and isinstance(m.get("content"), str):
                out.append(ToolResult(i, ("content",), m["content"],
                                      names.get(m.get("tool_call_id"))))
        return out

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        return message_tokens(item, counter)

    def item_chars(self, item: Any) -> int:
        return content_chars(item.get("content")) if isinstance(item, dict) else 0

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        return overhead_tokens(payload, counter)


OPENAI_CHAT = OpenAIChat()
