"""OpenAI Responses: `input` (a string or an item list) <-> Conversation.

`instructions` is the system part. Message items with role user open turns;
system/developer messages are fixed. A `function_call` and the
`function_call_output` with its `call_id` are one group; consecutive calls of
one response share a group; a `reasoning` item and the items of its response
after it (messages and calls up to the next reasoning item or user message, and
the results between them) are one group: the API refuses a response's item sent
back without its reasoning item (400 "... was provided without its required
'reasoning' item"), and a response may hold a preamble message and several calls,
each call's result appended right after it. An `item_reference` (an item the
server stored, sent by id) is the stand-in of what it refers to: it stays with
what follows it, like
reasoning, and a `function_call_output` whose call is not in the list pairs
with the references of its turn (which one is the call cannot be told: all
of them, and what lies between, are one group). Item types the gateway does
not know stay glued to the item before them. A request with
`previous_response_id` or `conversation` has server-side state: it is
measured, never evicted, and its results may answer calls the server holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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
    str_fields,
)
from gateway.measure.media import Piece
from gateway.measure.tokens import PER_MESSAGE, REPLY_PRIMING, TokenCounter
from gateway.policy.carry import ToolCall
from gateway.policy.carry.calls import CALL_CHARS
from gateway.policy.compact import ToolResult
from gateway.wire.base import Wire, json_head, json_text, text_of
from gateway.wire.openai_chat import content_pieces, part_pieces

# client-run tools: a call (with its `call_id`) the client answers with an output item;
# a type this list does not know yet is one too when it is spelled so (`*_call` with a
# `call_id`, `*_call_output`): server-run tools' items (web_search_call, ...) have no
# call_id, and a call split from its output is a 400
CALLS = frozenset(("function_call", "custom_tool_call", "computer_call", "local_shell_call",
                   "shell_call", "apply_patch_call"))
OUTPUTS = frozenset(t + "_output" for t in CALLS)


def is_call(it: dict[str, Any], t: str | None) -> bool:
    return t in CALLS or (t is not None and t.endswith("_call") and "call_id" in it)


def is_output(t: str | None) -> bool:
    return t in OUTPUTS or (t is not None and t.endswith("_call_output"))


def tool_name(it: dict[str, Any], t: str) -> str:
    """The tool a call is of: its `name`, or the built-in tool its type names
    (`shell_call`: shell, `apply_patch_call`: apply_patch)."""
    name = it.get("name")
    return name if isinstance(name, str) else t.removesuffix("_call")
# a tuple, not a set: a role that is an object (unhashable) is simply none of them
FIXED_ROLES = ("system", "developer")
REFERENCE = "item_reference"


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
    if is_call(it, t):
        return it.get("arguments", it.get("input"))
    if is_output(t):
        return it.get("output")
    return None


def parse(items: list[Any], prefix: str, min_score: float,
          server_state: bool = False, context: tuple[str, ...] = ()) -> Conversation:
    """`server_state`: the history continues one the server holds, so a result
    whose call is in neither the list nor a reference answers a call held there. User
    messages before the first reply that open with a `context` prefix are the client's
    context: fixed."""
    fixed: list[int] = []
    groups: list[Group] = []
    chars: list[int] = []
    text_chars: list[int] = []
    totals = Measure()
    has_meta = False
    turn = 0
    open_calls: dict[str, int] = {}
    refs_from: int | None = None  # the group of this turn's first item reference
    lead_in = False  # the last group holds only reasoning / references: it joins what follows
    reasoned: int | None = None  # the group of this turn's last reasoning item
    opening = bool(context)  # before the first item that is neither fixed nor context

    def with_reasoning() -> bool:
        """Join the group of the last reasoning item (its response's): True if joined."""
        nonlocal refs_from
        if reasoned is None:
            return False
        if reasoned != len(groups) - 1:
            merge_into(groups, reasoned, open_calls)
            if refs_from is not None and refs_from > reasoned:
                refs_from = reasoned
        return True

    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise Unplannable("message_not_object")
        t = item_type(it)
        content = _text_of(it)
        n_chars = content_chars(content)
        chars.append(n_chars)
        if type(content) is str and t == "message":
            n_text, weight = n_chars, 4 + approx_tokens(content)
        else:
            ms = measure(item_pieces(it))
            n_text, weight = ms.chars, ms.weight
            totals.add_media(ms)
        text_chars.append(n_text)
        pin, meta_here = message_pin(it, "input", i, first_text(content), prefix, min_score)
        has_meta = has_meta or meta_here
        if t != "message":
            opening = False
        if t == "message":
            role = it.get("role")
            if role in FIXED_ROLES:
                fixed.append(i)
                continue
            if opening and role == "user" and opens_with(content, context):
                fixed.append(i)
                continue
            opening = False
            if role == "user":
                turn += 1
                open_calls, refs_from, reasoned = {}, None, None
                groups.append(Group([i], turn, True))
            elif role == "assistant":
                if with_reasoning() or lead_in:
                    groups[-1].indices.append(i)
                else:
                    groups.append(Group([i], turn, False))
            else:
                raise Unplannable("unknown_role")
            lead_in = False
        elif is_call(it, t):
            cid = it.get("call_id")
            if not isinstance(cid, str):
                raise Unplannable("tool_call_without_id")
            prev = items[i - 1] if i else None
            joins = lead_in or (isinstance(prev, dict) and is_call(prev, item_type(prev)))
            if (with_reasoning() or joins) and groups:
                groups[-1].indices.append(i)
            else:
                groups.append(Group([i], turn, False))
            open_calls[cid] = len(groups) - 1
            lead_in = False
        elif is_output(t):
            cid = it.get("call_id")
            g = open_calls.get(cid) if isinstance(cid, str) else None
            if g is None:
                g = refs_from
            if g is None and not server_state:
                raise Unplannable("unpaired_tool_result")
            if g is None:  # its call is held server-side: nothing here to keep it with
                groups.append(Group([i], turn, False))
            else:
                if g != len(groups) - 1:
                    merge_into(groups, g, open_calls)
                    if refs_from is not None and refs_from > g:
                        refs_from = g
                    if reasoned is not None and reasoned > g:
                        reasoned = g
                groups[-1].indices.append(i)
            lead_in = False
        elif t in ("reasoning", REFERENCE):
            if lead_in:
                groups[-1].indices.append(i)
            else:
                groups.append(Group([i], turn, False))
            if t == REFERENCE and refs_from is None:
                refs_from = len(groups) - 1
            if t == "reasoning":
                reasoned = len(groups) - 1
            lead_in = True
        else:  # unknown item types stay with their neighbour
            if groups:
                groups[-1].indices.append(i)
            else:
                groups.append(Group([i], turn, False))
        grp = groups[-1]
        grp.chars += n_text
        grp.weight += weight
        if pin is not None:
            grp.pins.append((i, pin))
    return Conversation(
        n_messages=len(items), fixed=fixed, groups=groups, n_turns=turn, chars=chars,
        text_chars=text_chars, media_parts=totals.media, media_tokens=totals.media_tokens,
        media_chars=totals.media_chars, has_metadata=has_meta,
    )


def _dicts(v: Any) -> list[dict[str, Any]]:
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _output_pieces(output: Any) -> Iterator[Piece]:
    """A tool output: a string, a list of input_* parts, or one part (a screenshot)."""
    if isinstance(output, dict):
        yield from part_pieces(output)
    else:
        yield from content_pieces(output)


def item_pieces(it: dict[str, Any]) -> Iterator[Piece]:
    """One input item as the model reads it (README: "How items are counted")."""
    t = item_type(it)
    yield PER_MESSAGE + 1
    if t == "message":
        yield from content_pieces(it.get("content"))
    elif t in ("function_call", "custom_tool_call"):
        yield from str_fields(it, "name", "arguments", "input")
    elif is_output(t):  # function, custom tool, computer (a screenshot), shell, patch
        yield from _output_pieces(it.get("output"))
        for check in _dicts(it.get("acknowledged_safety_checks")):
            yield from str_fields(check, "code", "message")
    elif t in ("computer_call", "local_shell_call"):
        yield json_text(it.get("action"))
        for check in _dicts(it.get("pending_safety_checks")):
            yield from str_fields(check, "code", "message")
    elif t in ("mcp_call", "mcp_approval_request"):
        yield from str_fields(it, "server_label", "name", "arguments", "output", "error")
    elif t == "mcp_list_tools":
        yield from str_fields(it, "server_label", "error")
        for tool in _dicts(it.get("tools")):
            yield from str_fields(tool, "name", "description")
            for k in ("input_schema", "annotations"):
                if tool.get(k) is not None:
                    yield json_text(tool[k])
    elif t == "mcp_approval_response":
        yield from str_fields(it, "reason")
    elif t == "file_search_call":
        queries = it.get("queries")
        if isinstance(queries, list):
            yield from (q for q in queries if isinstance(q, str))
        for r in _dicts(it.get("results")):
            yield from str_fields(r, "filename", "text")
    elif t == "web_search_call":
        if it.get("action") is not None:
            yield json_text(it["action"])
    elif t == "reasoning":
        for part in _dicts(it.get("summary")) + _dicts(it.get("content")):
            yield from str_fields(part, "text")
        # opaque to the gateway: estimated at ~4 characters a token, never tokenized
        yield len(str(it.get("encrypted_content") or "")) // 4
    elif t == "image_generation_call":
        if isinstance(it.get("result"), str):  # the generated image, raw base64
            yield media.openai_b64_image(it["result"])
    elif t == "code_interpreter_call":
        yield from str_fields(it, "code")
        for out in _dicts(it.get("outputs")):
            if out.get("type") == "image":
                yield media.openai_image(out.get("url"), None)
            else:
                yield from str_fields(out, "logs")
    elif t != "item_reference":  # a reference is the id of an item the server holds
        yield from media.opaque(it)


class OpenAIResponses(Wire):
    name = "openai_responses"
    flavor = "openai"
    items_key = "input"
    stream_ends = (b"event: response.completed", b"event: response.failed",
                   b"event: response.incomplete")

    def items(self, payload: dict[str, Any]) -> list[Any] | None:
        v = payload.get("input")
        if isinstance(v, str):  # a single user message: nothing to evict, still measured
            return [{"role": "user", "content": v}]
        return v if isinstance(v, list) else None

    def skip_reason(self, payload: dict[str, Any]) -> str | None:
        if payload.get("previous_response_id") or payload.get("conversation"):
            return "server_state"
        return None

    def parse(self, items: list[Any], prefix: str, min_score: float,
              context: tuple[str, ...] = ()) -> Conversation:
        return parse(items, prefix, min_score, context=context)

    def parse_continuation(self, items: list[Any], prefix: str, min_score: float
                           ) -> Conversation:
        return parse(items, prefix, min_score, server_state=True)

    def starts_turn(self, item: Any) -> bool:
        return (isinstance(item, dict) and item_type(item) == "message"
                and item.get("role") == "user")

    def item_role(self, item: Any) -> str:
        t = item_type(item) if isinstance(item, dict) else None
        if t == "message":
            role = item.get("role")
            return role if role in ("user", "assistant") else "system"
        return "tool" if is_output(t) else "assistant"

    def item_text(self, item: Any) -> str:
        content = _text_of(item) if isinstance(item, dict) else None
        return content if isinstance(content, str) else text_of(content)

    def item_calls(self, item: Any) -> list[ToolCall]:
        # `arguments` is JSON text already; a custom tool's `input` is free text; a
        # built-in tool's call holds an object (local_shell_call's `action`: the command
        # and its working_directory; apply_patch_call's `operation`: path and diff)
        t = item_type(item) if isinstance(item, dict) else None
        if t is None or not is_call(item, t):
            return []
        args = item.get("arguments")
        if isinstance(args, str):
            return [ToolCall(tool_name(item, t), args[:CALL_CHARS])]
        given = next((item[k] for k in ("input", "action", "operation") if k in item), None)
        return [ToolCall(tool_name(item, t), json_head(given, CALL_CHARS))]

    def note_item(self, note: str) -> dict[str, Any]:
        return {"type": "message", "role": "developer", "content": note}

    def listed(self, value: bytes) -> bytes | None:
        # `input` as a string is one user message: the list `items()` reads it as
        return b'[{"role":"user","content":' + value + b"}]" if value[:1] == b'"' else None

    def tool_results(self, items: list[Any], start: int = 0,
                     names: dict[Any, str] | None = None) -> list[ToolResult]:
        # a string `output` (computer_call_output's is a screenshot object: not text)
        names = {} if names is None else names
        out = []
        for i, it in enumerate(items[start:], start):
            if not isinstance(it, dict):
                continue
            t = item_type(it)
            if t is not None and is_call(it, t):
                names[it.get("call_id")] = tool_name(it, t)
            elif is_output(t) and isinstance(it.get("output"), str):
                out.append(ToolResult(i, ("output",), it["output"], names.get(it.get("call_id"))))
        return out

    def item_tokens(self, item: Any, counter: TokenCounter) -> int:
        return counter.count_pieces(item_pieces(item)) if isinstance(item, dict) else 0

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
