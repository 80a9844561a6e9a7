"""OpenAI Responses: `input` (a string or an item list) <-> Conversation.

`instructions` is the system part. Message items with role user open turns;
system/developer messages are fixed. A `function_call` and the
`function_call_output` with its `call_id` are one group; consecutive calls of
one response share a group; a `reasoning` item stays with the call or message
it precedes. Item types the gateway does not know stay glued to the item
before them. A request with `previous_response_id` or `conversation` has
server-side state: it is measured, never evicted.
"""

from __future__ import annotations

from typing import Any

from ..conversation import (
    Conversation,
    Group,
    Unplannable,
    approx_weight,
    content_chars,
    first_text,
    merge_into,
    message_pin,
)
from ..policy.compact import ToolResult
from ..tokens import PER_MESSAGE, REPLY_PRIMING, TokenCounter
from .base import Wire, json_text, text_of
from .openai_chat import content_tokens

CALLS = frozenset(("function_call", "custom_tool_call", "computer_call", "local_shell_call"))
OUTPUTS = frozenset(
    ("function_call_output", "custom_tool_call_output", "computer_call_output",
     "local_shell_call_output")
)
# a tuple, not a set: a role that is an object (unhashable) is simply none of them
FIXED_ROLES = ("system", "developer")


def item_type(it: dict[str, Any]) -> str | None:
    t = it.get("type")
    if isinstance(t, str):
        return t
    return "message" if "role" in it else None


def _text_of(it: dict[str, Any]) -> Any:
    """What counts as an item's content: message content, call arguments, call output."""
    t = item_type(it)
    if t == "message":
        return it.get("content")
    if t in CALLS:
        return it.get("arguments", it.get("input"))
    if t in OUTPUTS:
        return it.get("output")
    return None


def parse(items: list[Any], prefix: str, min_score: float) -> Conversation:
    fixed: list[int] = []
    groups: list[Group] = []
    chars: list[int] = []
    media = 0
    has_meta = False
    turn = 0
    open_calls: dict[str, int] = {}
    lead_in = False  # the last group holds only reasoning: it joins what follows
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise Unplannable("message_not_object")
        t = item_type(it)
        content = _text_of(it)
        n_chars = content_chars(content)
        chars.append(n_chars)
        if isinstance(content, list):
            media += sum(
                1 for p in content if isinstance(p, dict) and p.get("type") in ("input_image",
                                                                                   "input_file")
            )
        pin, meta_here = message_pin(it, "input", i, first_text(content), prefix, min_score)
        has_meta = has_meta or meta_here
        if t == "message":
            role = it.get("role")
            if role in FIXED_ROLES:
                fixed.append(i)
                continue
            if role == "user":
                turn += 1
                open_calls = {}
                groups.append(Group([i], turn, True))
            elif role == "assistant":
                if lead_in:
                    groups[-1].indices.append(i)
                else:
                    groups.append(Group([i], turn, False))
            else:
                raise Unplannable("unknown_role")
            lead_in = False
        elif t in CALLS:
            cid = it.get("call_id")
            if not isinstance(cid, str):
                raise Unplannable("tool_call_without_id")
            prev = items[i - 1] if i else None
            joins = lead_in or (isinstance(prev, dict) and item_type(prev) in CALLS)
            if joins and groups:
                groups[-1].indices.append(i)
            else:
                groups.append(Group([i], turn, False))
            open_calls[cid] = len(groups) - 1
            lead_in = False
        elif t in OUTPUTS:
            cid = it.get("call_id")
            g = open_calls.get(cid) if isinstance(cid, str) else None
            if g is None:
                raise Unplannable("unpaired_tool_result")
            if g != len(groups) - 1:
                merge_into(groups, g, open_calls)
            groups[-1].indices.append(i)
            lead_in = False
        elif t == "reasoning":
            if lead_in:
                groups[-1].indices.append(i)
            else:
                groups.append(Group([i], turn, False))
            lead_in = True
        else:  # unknown item types stay with their neighbour
            if groups:
                groups[-1].indices.append(i)
            else:
                groups.append(Group([i], turn, False))
        grp = groups[-1]
        grp.chars += n_chars
        grp.weight += approx_weight(content, n_chars)
        if pin is not None:
            grp.pins.append((i, pin))
    return Conversation(
        n_messages=len(items), fixed=fixed, groups=groups, n_turns=turn, chars=chars,
        media_parts=media, has_metadata=has_meta,
    )


class OpenAIResponses(Wire):
    name = "openai_responses"
    flavor = "openai"
    items_key = "input"

    def items(self, payload: dict[str, Any]) -> list[Any] | None:
        v = payload.get("input")
        if isinstance(v, str):  # a single user message: nothing to evict, still measured
            return [{"role": "user", "content": v}]
        return v if isinstance(v, list) else None

    def skip_reason(self, payload: dict[str, Any]) -> str | None:
        if payload.get("previous_response_id") or payload.get("conversation"):
            return "server_state"
        return None

    def parse(self, items: list[Any], prefix: str, min_score: float) -> Conversation:
        return parse(items, prefix, min_score)

    def starts_turn(self, item: Any) -> bool:
        return (isinstance(item, dict) and item_type(item) == "message"
                and item.get("role") == "user")

    def item_role(self, item: Any) -> str:
        t = item_type(item) if isinstance(item, dict) else None
        if t == "message":
            role = item.get("role")
            return role if role in ("user", "assistant") else "system"
        return "tool" if t in OUTPUTS else "assistant"

    def item_text(self, item: Any) -> str:
        content = _text_of(item) if isinstance(item, dict) else None
        return content if isinstance(content, str) else text_of(content)

    def note_item(self, note: str) -> dict[str, Any]:
        return {"type": "message", "role": "developer", "content": note}

    def listed(self, value: bytes) -> bytes | None:
        # `input` as a string is one user message: the list `items()` reads it as
        return b'[{"role":"user","content":' + value + b"}]" if value[:1] == b'"' else None

    def tool_results(self, items: list[Any]) -> list[ToolResult]:
        # a string `output` (computer_call_output's is a screenshot object: not text)
        names: dict[Any, str] = {}
        out = []
        for i, it in enumerate(items):
            if not isinstance(it, dict):
                continue
            t = item_type(it)
            if t in CALLS and isinstance(it.get("name"), str):
                names[it.get("call_id")] = it["name"]
            elif t in OUTPUTS and isinstance(it.get("output"), str):
                out.append(ToolResult(i, ("output",), it["output"], names.get(it.get("call_id"))))
        return out

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        n = PER_MESSAGE + 1 + content_tokens(_text_of(item), counter)
        if item_type(item) in CALLS:
            n += counter.count(str(item.get("name", "")))
        elif item_type(item) == "reasoning":
            for s in item.get("summary") or []:
                if isinstance(s, dict):
                    n += counter.count(str(s.get("text", "")))
            n += len(str(item.get("encrypted_content") or "")) // 4
        return n

    def item_chars(self, item: Any) -> int:
        return content_chars(_text_of(item)) if isinstance(item, dict) else 0

    def overhead_tokens(self, payload: dict[str, Any], counter: TokenCounter) -> int:
        n = REPLY_PRIMING
        instructions = payload.get("instructions")
        if isinstance(instructions, str):
            n += counter.count(instructions)
        if payload.get("tools"):
            n += counter.count(json_text(payload["tools"]))
        return n

    def fixed_chars(self, payload: dict[str, Any]) -> int:
        instructions = payload.get("instructions")
        return len(instructions) if isinstance(instructions, str) else 0


OPENAI_RESPONSES = OpenAIResponses()
