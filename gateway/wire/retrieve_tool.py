"""memgate's retrieval tool in each wire's request format (memory.retrieve).

A request whose cut leaves something out carries one extra tool, which memgate answers
itself (proxy.retrieve_loop): its definition in the wire's own format, always the same
bytes for the same config, appended to the client's tools (or as the only tool), so that
adding it changes the cached prefix once. `forbids` says when a request must not get it;
`next_body` is the body of the next round once the model has called it. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from gateway.config.schema import RetrieveRules
from gateway.wire.base import Wire

_SCHEMA = {
    "type": "object",
    "properties": {
        "handle": {"type": "string",
                   "description": "the handle a [memgate: ...] marker names"},
        "query": {"type": "string",
                  "description": "words to look for: only the passages holding them come back"},
        "offset": {"type": "integer",
                   "description": "where a long result goes on (the offset its last part gave)"},
    },
    "required": ["handle"],
}


def tool_def(wire: Wire, rules: RetrieveRules) -> bytes:
    """The tool's definition in `wire`'s format, as the bytes forwarded (one per config)."""
    name, desc = rules.tool_name, rules.description
    if wire.name == "anthropic_messages":
        tool: dict[str, Any] = {"name": name, "description": desc, "input_schema": _SCHEMA}
    elif wire.name == "openai_responses":
        tool = {"type": "function", "name": name, "description": desc,
                "parameters": _SCHEMA, "strict": False}
    else:
        tool = {"type": "function",
                "function": {"name": name, "description": desc, "parameters": _SCHEMA}}
    return orjson.dumps(tool)


def tool_names(wire: Wire, payload: dict[str, Any]) -> set[str]:
    """The names of the client's own tools."""
    out = set()
    for t in payload.get("tools") or ():
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if wire.name == "openai_chat" else t
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out.add(fn["name"])
    return out


def forbids(wire: Wire, payload: dict[str, Any], rules: RetrieveRules,
            model: str | None) -> str | None:
    """Why this request must not get the tool (None: it may): the client's own tool of
    that name; a tool_choice other than the model's free choice (none, a forced or an
    allowed-list choice, required / any: the model would be pushed to call it); several
    choices (chat `n`); a Responses request the provider stores (`store` not false: its
    id may be chained onto later); a model that takes no tools."""
    if not rules.takes_tools(model):
        return "model_without_tools"
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        return "tools_unreadable"
    if rules.tool_name in tool_names(wire, payload):
        return "name_taken"
    choice = payload.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind is not None and kind != "auto":
        return "tool_choice"
    n = payload.get("n")
    if wire.name == "openai_chat" and n is not None and n != 1:
        return "n_choices"
    if wire.name == "openai_responses" and payload.get("store") is not False:
        # the provider keeps each round's response: the client, given the first one's
        # id, could chain a later request onto a response that ends in a call of a tool
        # it never answered (or the rounds would land in its conversation)
        return "stored_response"
    return None


def next_body(wire: Wire, sent: dict[str, Any], turn: list[dict[str, Any]],
              results: Sequence[tuple[str, str]], final: bool) -> bytes:
    """The next round's body: the round's request `sent` (parsed) with the model's
    `turn` and memgate's answers to its calls (`results`: call id, text) appended; with
    `final`, the model is asked to answer without tools (tool_choice none)."""
    body = dict(sent)
    key = wire.items_key
    items = list(wire.items(body) or [])  # (a Responses `input` string: its one message)
    items += turn
    if wire.name == "anthropic_messages":
        items.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": cid, "content": text}
            for cid, text in results]})
        if final:
            body["tool_choice"] = {"type": "none"}
    elif wire.name == "openai_responses":
        items += [{"type": "function_call_output", "call_id": cid, "output": text}
                  for cid, text in results]
        if final:
            body["tool_choice"] = "none"
    else:
        items += [{"role": "tool", "tool_call_id": cid, "content": text}
                  for cid, text in results]
        if final:
            body["tool_choice"] = "none"
    body[key] = items
    return orjson.dumps(body)
