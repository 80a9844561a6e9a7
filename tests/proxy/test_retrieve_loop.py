"""memory.retrieve end to end: the openai and anthropic SDKs -> the gateway -> an aiohttp
upstream playing a model that calls memgate's retrieval tool, on every wire, whole and
streamed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from tests.conftest import SECRET, Gateway, GatewayFactory

TOOL = "memgate_retrieve"
PLANTED = "VAULT-7731"
PLANTED_RE = re.compile(r"VAULT-\d+")
HANDLE_RE = re.compile(r'handle "((?:cmp|hist)-[0-9a-f]+)"')
WIRES = ("openai_chat", "anthropic_messages", "openai_responses")
PATHS = {"openai_chat": "/v1/chat/completions", "anthropic_messages": "/v1/messages",
         "openai_responses": "/v1/responses"}
PREAMBLE = "Let me look that up. "
MODEL = {"openai_chat": "gpt-4o-mini", "anthropic_messages": "claude-sonnet-4-5",
         "openai_responses": "gpt-4o-mini"}
RETRIEVE = {"enabled": True, "max_rounds": 3}


def budget(tokens: int) -> dict[str, Any]:
    return {"max_tokens": tokens, "max_chars": None, "max_messages": None, "max_turns": None}


# budgets that cut the vault conversation: its first turn dropped (the carry note names a
# hist- handle), or only the vault file's result compacted (its marker names a cmp-
# handle); either way the planted value is left out of the forwarded body
HIST, CMP = 450, 1000
MEMORY = {"enable_eviction": True, "budget": budget(HIST),
          "eviction": {"order": ["pinned", "recent_turns", "compact_tools", "length"],
                       "recall_share": 0},
          "carry": {"enabled": True}, "retrieve": RETRIEVE}


# ------------------------------------------------------------------ the conversation

def vault_file() -> str:
    """A tool result of ~3,600 characters, the planted value on one line in its middle."""
    lines = [f"row {i:03d}: inventory entry {i * 7} shelved in aisle {i % 9}"
             for i in range(80)]
    lines.insert(40, f"the vault code is {PLANTED}")
    return "\n".join(lines)


def turns(n: int) -> list[tuple[str, str]]:
    return [(f"question {t}: " + "tell me about the weather today " * 12,
             f"answer {t}: " + "sunny with a light breeze " * 12) for t in range(n)]


LAST_QUESTION = "What was the code in the vault file?"


def conversation(wire: str, result: str | None = None, n_turns: int = 3) -> dict[str, Any]:
    """The SDK call's arguments: an early tool call whose big `result` (by default the
    vault file) holds the planted value, `n_turns` long turns, the question about it;
    the client's own tool read_file."""
    read = {"path": "vault.txt"}
    result = vault_file() if result is None else result
    if wire == "openai_chat":
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Read the vault file."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_read", "type": "function",
                 "function": {"name": "read_file", "arguments": orjson.dumps(read).decode()}}]},
            {"role": "tool", "tool_call_id": "call_read", "content": result},
            {"role": "assistant", "content": "I read the vault file."}]
        for q, a in turns(n_turns):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": LAST_QUESTION})
        return {"messages": msgs, "tools": [{"type": "function", "function": {
            "name": "read_file", "strict": True, "parameters": {
                "type": "object", "properties": {"path": {"type": "string"}},
                "required": ["path"], "additionalProperties": False}}}]}
    if wire == "anthropic_messages":
        msgs = [{"role": "user", "content": "Read the vault file."},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_read", "name": "read_file",
                     "input": read}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_read",
                     "content": result}]},
                {"role": "assistant", "content": "I read the vault file."}]
        for q, a in turns(n_turns):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": LAST_QUESTION})
        return {"system": "You are terse.", "messages": msgs, "max_tokens": 1024,
                "tools": [{"name": "read_file", "input_schema": {
                    "type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}}]}
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Read the vault file."},
        {"type": "function_call", "call_id": "call_read", "name": "read_file",
         "arguments": orjson.dumps(read).decode()},
        {"type": "function_call_output", "call_id": "call_read", "output": result},
        {"role": "assistant", "content": "I read the vault file."}]
    for q, a in turns(n_turns):
        items += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    items.append({"role": "user", "content": LAST_QUESTION})
    # store false, as agents send it (Codex): a stored response may be chained onto by id,
    # and memgate then never adds its tool (test_a_stored_response_gets_no_tool)
    return {"instructions": "You are terse.", "input": items, "store": False, "tools": [
        {"type": "function", "name": "read_file", "strict": False, "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}},
            "required": ["path"]}}]}


# ------------------------------------------------------------------ the model

def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def tool_names(wire: str, body: dict[str, Any]) -> list[Any]:
    return [(t.get("function") or {}).get("name") if wire == "openai_chat" else t.get("name")
            for t in body.get("tools") or []]


def retrieve_result(wire: str, body: dict[str, Any]) -> str | None:
    """The text of the retrieval tool's results when they are the request's last items."""
    if wire == "openai_chat":
        msgs = body["messages"]
        ours = {c["id"] for m in msgs for c in m.get("tool_calls") or []
                if c["function"]["name"] == TOOL}
        tail = []
        for m in reversed(msgs):
            if m["role"] != "tool":
                break
            tail.append(m)
        got = [m["content"] for m in reversed(tail) if m["tool_call_id"] in ours]
    elif wire == "anthropic_messages":
        msgs = body["messages"]
        ours = {b["id"] for m in msgs if isinstance(m["content"], list) for b in m["content"]
                if b.get("type") == "tool_use" and b.get("name") == TOOL}
        last = msgs[-1]["content"] if msgs[-1]["role"] == "user" else []
        got = [b["content"] for b in last if isinstance(b, dict)
               and b.get("type") == "tool_result" and b.get("tool_use_id") in ours]
    else:
        items = body["input"]
        ours = {i["call_id"] for i in items
                if i.get("type") == "function_call" and i.get("name") == TOOL}
        tail = []
        for i in reversed(items):
            if i.get("type") != "function_call_output":
                break
            tail.append(i)
        got = [i["output"] for i in reversed(tail) if i["call_id"] in ours]
    return "\n".join(got) if got else None


def choice_is_none(wire: str, body: dict[str, Any]) -> bool:
    choice = body.get("tool_choice")
    return choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none")


def usage_of(wire: str, n: int) -> dict[str, Any]:
    """The n-th answer's usage as the provider spells it (different numbers per round)."""
    p, c, cached = 1000 * n + 37, 10 * n + 3, 100 * n
    if wire == "openai_chat":
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0,
                                              "rejected_prediction_tokens": 0}}
    if wire == "anthropic_messages":
        return {"input_tokens": p, "cache_creation_input_tokens": 50 * n,
                "cache_read_input_tokens": cached, "output_tokens": c,
                "service_tier": "standard"}
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": p + c}


def summed(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The oracle: every number summed over the rounds, nested ones too."""
    out: dict[str, Any] = {}
    for u in usages:
        for k, v in u.items():
            if isinstance(v, dict):
                out[k] = summed([out.get(k, {}), v])
            elif isinstance(v, int):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


# a turn the model answers: ("text", str) and ("call", call id, tool name, arguments)
Part = tuple[str, ...]


@dataclass
class Model:
    """An upstream playing a model on the three wires. It calls memgate_retrieve (with the
    first handle the request names, or `handle`) when the request offers the tool and its
    last items are not the tool's results, after `preamble`; given the results it answers
    quoting the planted value found in them. `always`: it calls the tool whatever it got
    (with `obeys_none` false, under tool_choice none too); `mixed`: the client's read_file
    in the same answer; requests from the `fail_from`-th on are answered 500. It records
    every body, the handles it asked for and the usage it sent."""

    url: str = ""
    preamble: str = PREAMBLE
    handle: str | None = None
    always: bool = False
    mixed: bool = False
    fail_from: int | None = None
    fail_status: int = 500  # 200: an error object as a 200 (some routers answer so)
    obeys_none: bool = True
    delta_output_only: bool = False  # Anthropic: message_delta counts output tokens only
    received: list[bytes] = field(default_factory=list)
    called: list[str] = field(default_factory=list)  # the handles it asked for
    usage: list[dict[str, Any]] = field(default_factory=list)

    def bodies(self) -> list[dict[str, Any]]:
        return [orjson.loads(r) for r in self.received]

    def turn(self, wire: str, body: dict[str, Any]) -> tuple[list[Part], bool]:
        """(the answer's parts, whether it calls tools)."""
        n = len(self.received)
        result = retrieve_result(wire, body)
        offered = TOOL in tool_names(wire, body)
        if self.always:
            calls = not self.obeys_none or offered and not choice_is_none(wire, body)
        else:
            calls = offered and result is None
        if calls:
            texts = [s for k, v in body.items() if k != "tools" for s in strings(v)]
            found = HANDLE_RE.search("\n".join(texts))
            handle = self.handle or (found.group(1) if found else "none-named")
            self.called.append(handle)
            parts: list[Part] = [("text", self.preamble)] if self.preamble and n == 1 else []
            parts.append(("call", f"call_{n}_0", TOOL, orjson.dumps({"handle": handle}).decode()))
            if self.mixed:
                parts.append(("call", f"call_{n}_1", "read_file", '{"path": "notes.txt"}'))
            return parts, True
        if result is not None:
            planted = PLANTED_RE.search(result)
            return [("text", f"The code is {planted.group(0)}." if planted
                     else f"Nothing there: {result}")], False
        return [("text", "A plain answer.")], False


def chat_answer(n: int, parts: list[Part], calls: bool, usage: dict[str, Any]
                ) -> dict[str, Any]:
    text = "".join(p[1] for p in parts if p[0] == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None,
                               "annotations": []}
    tcs = [{"id": p[1], "type": "function", "function": {"name": p[2], "arguments": p[3]}}
           for p in parts if p[0] == "call"]
    if tcs:
        message["tool_calls"] = tcs
    return {"id": f"chatcmpl-r{n}", "object": "chat.completion", "created": 1730000000 + n,
            "model": "gpt-4o-mini-2024-07-18", "service_tier": "default",
            "system_fingerprint": "fp_test", "usage": usage,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if calls else "stop"}]}


def chat_chunks(n: int, parts: list[Part], calls: bool, usage: dict[str, Any] | None
                ) -> list[bytes]:
    head = {"id": f"chatcmpl-r{n}", "object": "chat.completion.chunk",
            "created": 1730000000 + n, "model": "gpt-4o-mini-2024-07-18",
            "service_tier": "default", "system_fingerprint": "fp_test"}
    if usage is not None:  # stream_options.include_usage: null on every chunk but the last
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + orjson.dumps({**head, "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}) + b"\n\n"

    out = [chunk({"role": "assistant", "content": "", "refusal": None})]
    index = 0
    for p in parts:
        if p[0] == "text":
            out += [chunk({"content": w}) for w in re.findall(r"\S+\s*", p[1])]
            continue
        out.append(chunk({"tool_calls": [{"index": index, "id": p[1], "type": "function",
                                          "function": {"name": p[2], "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": a}}]})
                for a in (p[3][:9], p[3][9:])]
        index += 1
    out.append(chunk({}, "tool_calls" if calls else "stop"))
    if usage is not None:
        out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    return out + [b"data: [DONE]\n\n"]


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + orjson.dumps(event) + b"\n\n"


def anthropic_blocks(parts: list[Part]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": p[1]} if p[0] == "text" else
            {"type": "tool_use", "id": p[1].replace("call_", "toolu_"), "name": p[2],
             "input": orjson.loads(p[3])} for p in parts]


def anthropic_answer(n: int, parts: list[Part], calls: bool, usage: dict[str, Any]
                     ) -> dict[str, Any]:
    return {"id": f"msg_r{n}", "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-5-20250929", "content": anthropic_blocks(parts),
            "stop_reason": "tool_use" if calls else "end_turn", "stop_sequence": None,
            "usage": usage}


def anthropic_events(n: int, parts: list[Part], calls: bool, usage: dict[str, Any],
                     output_only: bool = False) -> list[bytes]:
    """A message's events; its message_delta's usage the cumulative counts (as the API
    sends them now), or with `output_only` output_tokens alone (as it used to)."""
    start = {**anthropic_answer(n, [], calls, usage), "stop_reason": None,
             "usage": {**usage, "output_tokens": 1}}
    out = [sse({"type": "message_start", "message": start}), sse({"type": "ping"})]
    for i, block in enumerate(anthropic_blocks(parts)):
        if block["type"] == "text":
            out.append(sse({"type": "content_block_start", "index": i,
                            "content_block": {"type": "text", "text": ""}}))
            out += [sse({"type": "content_block_delta", "index": i,
                         "delta": {"type": "text_delta", "text": w}})
                    for w in re.findall(r"\S+\s*", block["text"])]
        else:
            args = orjson.dumps(block["input"]).decode()
            out.append(sse({"type": "content_block_start", "index": i,
                            "content_block": {**block, "input": {}}}))
            out += [sse({"type": "content_block_delta", "index": i,
                         "delta": {"type": "input_json_delta", "partial_json": a}})
                    for a in ("", args[:7], args[7:])]
        out.append(sse({"type": "content_block_stop", "index": i}))
    counts = ({"output_tokens": usage["output_tokens"]} if output_only else
              {k: v for k, v in usage.items() if k != "service_tier"})
    out += [sse({"type": "message_delta",
                 "delta": {"stop_reason": "tool_use" if calls else "end_turn",
                           "stop_sequence": None}, "usage": counts}),
            sse({"type": "message_stop"})]
    return out


def responses_items(n: int, parts: list[Part]) -> list[dict[str, Any]]:
    return [{"type": "message", "id": f"msg_r{n}_{k}", "status": "completed",
             "role": "assistant", "content": [{"type": "output_text", "text": p[1],
                                               "annotations": [], "logprobs": []}]}
            if p[0] == "text" else
            {"type": "function_call", "id": f"fc_r{n}_{k}", "call_id": p[1], "name": p[2],
             "arguments": p[3], "status": "completed"} for k, p in enumerate(parts)]


def responses_answer(n: int, parts: list[Part], usage: dict[str, Any] | None,
                     body: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": f"resp_r{n}", "object": "response", "created_at": 1730000000 + n,
            "status": status, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "model": "gpt-4o-mini-2024-07-18",
            "output": responses_items(n, parts) if status == "completed" else [],
            "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools", []),
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": usage, "metadata": {}}


def responses_events(n: int, parts: list[Part], usage: dict[str, Any],
                     body: dict[str, Any]) -> list[bytes]:
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": responses_answer(n, [], None, body,
                                                                  "in_progress")},
        {"type": "response.in_progress", "response": responses_answer(n, [], None, body,
                                                                      "in_progress")}]
    for at, item in enumerate(responses_items(n, parts)):
        ref = {"item_id": item["id"], "output_index": at}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append({"type": "response.output_item.added", "output_index": at,
                           "item": {**item, "status": "in_progress", "content": []}})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append({"type": "response.content_part.added", **ref,
                           "content_index": 0, "part": part})
            events += [{"type": "response.output_text.delta", **ref, "content_index": 0,
                        "delta": w, "logprobs": []} for w in re.findall(r"\S+\s*", text)]
            events.append({"type": "response.output_text.done", **ref, "content_index": 0,
                           "text": text, "logprobs": []})
            events.append({"type": "response.content_part.done", **ref, "content_index": 0,
                           "part": {**part, "text": text}})
        else:
            events.append({"type": "response.output_item.added", "output_index": at,
                           "item": {**item, "status": "in_progress", "arguments": ""}})
            events += [{"type": "response.function_call_arguments.delta", **ref, "delta": a}
                       for a in (item["arguments"][:8], item["arguments"][8:])]
            events.append({"type": "response.function_call_arguments.done", **ref,
                           "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": at,
                       "item": item})
    events.append({"type": "response.completed",
                   "response": responses_answer(n, parts, usage, body)})
    return [sse({**e, "sequence_number": seq}) for seq, e in enumerate(events)]


@pytest.fixture
async def model(aiohttp_server: Any) -> Model:
    m = Model()

    def handler(wire: str) -> Any:
        async def answer(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            m.received.append(raw)
            n = len(m.received)
            if m.fail_from is not None and n >= m.fail_from:
                return web.json_response({"type": "error", "error": {
                    "type": "api_error", "message": "Internal server error"}},
                    status=m.fail_status)
            body = orjson.loads(raw)
            parts, calls = m.turn(wire, body)
            usage = usage_of(wire, n)
            stream = bool(body.get("stream"))
            # a chat stream carries usage only when the client asks for it
            counted = not (wire == "openai_chat" and stream and not (
                body.get("stream_options") or {}).get("include_usage"))
            if counted:
                m.usage.append(usage)
            if not stream:
                answer = (chat_answer(n, parts, calls, usage) if wire == "openai_chat" else
                          anthropic_answer(n, parts, calls, usage)
                          if wire == "anthropic_messages" else
                          responses_answer(n, parts, usage, body))
                return web.json_response(answer, headers={"x-request-id": f"req_{n}"})
            events = (chat_chunks(n, parts, calls, usage if counted else None)
                      if wire == "openai_chat" else
                      anthropic_events(n, parts, calls, usage, m.delta_output_only)
                      if wire == "anthropic_messages" else
                      responses_events(n, parts, usage, body))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in events:
                await resp.write(event)
            await resp.write_eof()
            return resp
        return answer

    app = web.Application(client_max_size=1 << 26)
    for wire, path in PATHS.items():
        app.router.add_post(path, handler(wire))
    server = await aiohttp_server(app)
    m.url = str(server.make_url("")).rstrip("/")
    return m


async def start(gateway: GatewayFactory, model: Model, retrieve: dict[str, Any] | None = None,
                store: dict[str, Any] | None = None, **memory: Any) -> Gateway:
    mem = {**MEMORY, **memory}
    if retrieve is not None:
        mem["retrieve"] = retrieve
    top = {"store": store} if store is not None else {}
    return await gateway(memory=mem, upstream_url=model.url, **top)


# ------------------------------------------------------------------ the callers

@dataclass
class Answer:
    """What the SDK made of the gateway's answer, the same on every wire."""

    text: str
    calls: list[tuple[str, str, str]]  # the client's tool calls: (name, arguments, id)
    stop: str | None
    usage: dict[str, Any]
    dump: str  # the SDK object as JSON


async def ask(gw: Gateway, wire: str, stream: bool, key: str = SECRET, session: str = "s-1",
              args: dict[str, Any] | None = None, **extra: Any) -> Answer:
    """One call through the real SDK (its stream helpers accumulate a streamed answer,
    checking the events' order and indices); `args`: the conversation, by default the
    vault one."""
    args = {**(conversation(wire) if args is None else args), "model": MODEL[wire], **extra}
    headers = {"X-Session-Id": session}
    if wire == "anthropic_messages":
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0,
                                            default_headers=headers) as a:
            if stream:
                async with a.messages.stream(**args) as s:
                    message = await s.get_final_message()
            else:
                message = await a.messages.create(**args)
        return Answer("".join(b.text for b in message.content if b.type == "text"),
                      [(b.name, orjson.dumps(b.input).decode(), b.id)
                       for b in message.content if b.type == "tool_use"],
                      message.stop_reason, message.usage.model_dump(),
                      message.model_dump_json())
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0,
                                  default_headers=headers) as c:
        if wire == "openai_chat":
            if stream:
                async with c.chat.completions.stream(
                        **args, stream_options={"include_usage": True}) as s:
                    done = await s.get_final_completion()
            else:
                done = await c.chat.completions.create(**args)
            msg = done.choices[0].message
            assert done.usage is not None
            return Answer(msg.content or "", [(t.function.name, t.function.arguments, t.id)
                                              for t in msg.tool_calls or []],
                          done.choices[0].finish_reason, done.usage.model_dump(),
                          done.model_dump_json())
        if stream:
            async with c.responses.stream(**args) as s:
                resp = await s.get_final_response()
        else:
            resp = await c.responses.create(**args)
    assert resp.usage is not None
    return Answer(resp.output_text, [(i.name, i.arguments, i.call_id) for i in resp.output
                                     if i.type == "function_call"],
                  resp.status, resp.usage.model_dump(),
                  # a response echoes the request's tools and tool_choice: the forwarded
                  # request's, memgate's tool among them
                  resp.model_dump_json(exclude={"tools", "tool_choice"}))


def same_usage(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """`got` (the SDK's, with fields the provider did not send) holds `want`'s numbers."""
    return all(same_usage(got.get(k) or {}, v) if isinstance(v, dict) else got.get(k) == v
               for k, v in want.items())


END = {"openai_chat": "stop", "anthropic_messages": "end_turn",
       "openai_responses": "completed"}
TOOL_STOP = {"openai_chat": "tool_calls", "anthropic_messages": "tool_use",
             "openai_responses": "completed"}
PARAMS = [pytest.param(w, s, id=f"{w}-{'stream' if s else 'whole'}")
          for w in WIRES for s in (False, True)]


# ------------------------------------------------------------------ the tests

@pytest.mark.parametrize(("wire", "stream"), PARAMS)
async def test_one_answer_with_what_the_cut_left_out(
        gateway: GatewayFactory, model: Model, wire: str, stream: bool) -> None:
    """The model retrieves what the cut left out: the SDK gets one answer with the
    planted value, no retrieval call, usage the sum of both rounds."""
    gw = await start(gateway, model)
    got = await ask(gw, wire, stream)
    assert got.text == PREAMBLE + f"The code is {PLANTED}."
    assert got.calls == [] and TOOL not in got.dump
    assert got.stop == END[wire]
    assert len(model.usage) == 2 and same_usage(got.usage, summed(model.usage)), (
        got.usage, model.usage)
    first, second = model.bodies()
    assert TOOL in tool_names(wire, first) and PLANTED not in model.received[0].decode()
    assert retrieve_result(wire, first) is None
    assert PLANTED in (retrieve_result(wire, second) or "")
    # the second round is the first one's body with the model's turn and the result
    key = "messages" if wire != "openai_responses" else "input"
    assert second[key][:len(first[key])] == first[key]
    assert {k: v for k, v in second.items() if k != key} == {
        k: v for k, v in first.items() if k != key}
    ev = (await gw.wait_mem(1))[-1]
    assert ev["retrieve"] == "tool" and ev["retrieve_rounds"] == "1"
    assert "retrieve_error" not in ev
    # the retrieval round's own tokens: every prompt token it read (cached ones included)
    inside = model.usage[1]
    want_in = (inside["prompt_tokens"] if wire == "openai_chat" else inside["input_tokens"]
               + inside["cache_read_input_tokens"] + inside["cache_creation_input_tokens"]
               if wire == "anthropic_messages" else inside["input_tokens"])
    assert ev["retrieve_in_tokens"] == str(want_in)
    assert ev["retrieve_out_tokens"] == str(10 * 2 + 3)


async def raw_events(gw: Gateway, wire: str, **extra: Any) -> list[tuple[str, Any]]:
    """The gateway's streamed answer read as bytes: (event type, data) pairs."""
    body = {**conversation(wire), "model": MODEL[wire], "stream": True, **extra}
    if wire == "openai_chat":
        body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {SECRET}", "x-api-key": SECRET,
               "anthropic-version": "2023-06-01", "X-Session-Id": "s-raw"}
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + PATHS[wire], data=orjson.dumps(body), headers=headers) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = await r.read()
    assert raw.endswith(b"\n\n")
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        kind, data = "", b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                kind = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        value = None if data == b"[DONE]" else orjson.loads(data)
        out.append((kind or ("[DONE]" if value is None else "chunk"), value))
    return out


@pytest.mark.parametrize("wire", WIRES)
async def test_a_call_with_no_text_before_it_leaves_no_trace(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """Round 1 is the retrieval call alone: the client's stream starts once and its first
    content (index 0) is round 2's answer."""
    model.preamble = ""
    gw = await start(gateway, model)
    got = await ask(gw, wire, True)
    assert got.text == f"The code is {PLANTED}." and got.calls == [] and got.stop == END[wire]
    events = await raw_events(gw, wire)
    assert TOOL not in shown(events)
    kinds = [k for k, _ in events]
    if wire == "anthropic_messages":
        assert [v["index"] for k, v in events if k == "content_block_start"] == [0]
        assert kinds.count("message_start") == kinds.count("message_stop") == 1
    elif wire == "openai_responses":
        assert [v["output_index"] for k, v in events
                if k == "response.output_item.added"] == [0]
        assert kinds.count("response.created") == kinds.count("response.completed") == 1
    else:
        assert kinds.count("[DONE]") == 1
        text = "".join(ch["delta"].get("content") or "" for _, v in events if v
                       for ch in v["choices"])
        assert text == f"The code is {PLANTED}."


async def test_a_chat_stream_without_usage_gets_none(
        gateway: GatewayFactory, model: Model) -> None:
    """A chat stream whose client did not ask for usage: no round sends any, the merged
    stream has no usage chunk and ends once."""
    gw = await start(gateway, model)
    body = {**conversation("openai_chat"), "model": "gpt-4o-mini", "stream": True}
    headers = {"Authorization": f"Bearer {SECRET}", "X-Session-Id": "s-1"}
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + PATHS["openai_chat"], data=orjson.dumps(body), headers=headers) as r:
        raw = await r.read()
    assert len(model.received) == 2 and model.usage == []
    assert raw.count(b"data: [DONE]") == 1 and raw.endswith(b"data: [DONE]\n\n")
    chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n\n")
              if line.startswith(b"data: {")]
    assert all(c.get("usage") is None for c in chunks)
    assert "".join(ch["delta"].get("content") or "" for c in chunks
                   for ch in c["choices"]) == PREAMBLE + f"The code is {PLANTED}."


def shown(events: list[tuple[str, Any]]) -> str:
    """The events' data as JSON, without what a Responses object echoes of the request
    (its tools and tool_choice: the forwarded request's, memgate's tool among them)."""
    def echo_cut(v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("response"), dict):
            response = {k: x for k, x in v["response"].items()
                        if k not in ("tools", "tool_choice")}
            return {**v, "response": response}
        return v
    return orjson.dumps([echo_cut(v) for _, v in events]).decode()


async def test_anthropic_usage_is_summed_when_message_delta_counts_output_only(
        gateway: GatewayFactory, model: Model) -> None:
    """An upstream whose message_delta carries output_tokens alone: the client's
    message_delta still carries every round's input and cache counts summed, which the
    SDK takes as the message's totals."""
    model.delta_output_only = True
    gw = await start(gateway, model)
    got = await ask(gw, "anthropic_messages", True)
    assert got.text == PREAMBLE + f"The code is {PLANTED}."
    assert same_usage(got.usage, summed(model.usage)), (got.usage, model.usage)


@pytest.mark.parametrize("wire", WIRES)
async def test_the_raw_stream_has_one_start_and_one_end(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """Read as raw SSE, the merged stream has one opening and one end, contiguous
    indices, and (Responses) consecutive sequence numbers."""
    gw = await start(gateway, model)
    events = await raw_events(gw, wire)
    kinds = [k for k, _ in events]
    assert len(model.received) == 2
    assert TOOL not in shown(events)
    if wire == "openai_chat":
        assert kinds.count("[DONE]") == 1 and kinds[-1] == "[DONE]"
        chunks = [v for k, v in events if k == "chunk"]
        assert {c["id"] for c in chunks} == {"chatcmpl-r1"}
        assert sum(1 for c in chunks for ch in c["choices"] if "role" in ch["delta"]) == 1
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]
                    if ch["finish_reason"]]
        assert finishes == ["stop"]
        usages = [c["usage"] for c in chunks if c.get("usage")]
        assert usages == [summed(model.usage)]
    elif wire == "anthropic_messages":
        assert kinds.count("message_start") == 1 and kinds[0] == "message_start"
        assert kinds.count("message_stop") == 1 and kinds[-1] == "message_stop"
        assert kinds.count("message_delta") == 1
        starts = [v["index"] for k, v in events if k == "content_block_start"]
        assert starts == list(range(len(starts))) == [0, 1]
        delta = next(v for k, v in events if k == "message_delta")
        assert delta["delta"]["stop_reason"] == "end_turn"
        want = summed(model.usage)
        assert {k: delta["usage"][k] for k in delta["usage"]} == {
            k: want[k] for k in delta["usage"]}
        assert set(delta["usage"]) >= {"input_tokens", "output_tokens",
                                       "cache_read_input_tokens",
                                       "cache_creation_input_tokens"}
    else:
        assert kinds.count("response.created") == 1 and kinds[0] == "response.created"
        assert kinds.count("response.completed") == 1 and kinds[-1] == "response.completed"
        seqs = [v["sequence_number"] for _, v in events]
        assert seqs == list(range(len(seqs)))
        added = [v["output_index"] for k, v in events if k == "response.output_item.added"]
        assert added == [0, 1]
        done = events[-1][1]["response"]
        assert done["id"] == "resp_r1" and done["usage"] == summed(model.usage)
        assert [i["id"] for i in done["output"]] == ["msg_r1_0", "msg_r2_0"]


def result_got(model: Model, wire: str, n: int = -1) -> str:
    """The retrieval tool's results in the n-th request the model got ("" if none)."""
    return retrieve_result(wire, model.bodies()[n]) or ""


def handles_in(raw: bytes) -> list[str]:
    return HANDLE_RE.findall("\n".join(strings(orjson.loads(raw))))


@pytest.mark.parametrize("wire", WIRES)
async def test_a_compacted_results_handle_gives_the_clients_original(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """Only the vault file's result is compacted (nothing dropped): its marker's handle
    gives the model the client's original text, unchanged."""
    gw = await start(gateway, model, budget=budget(CMP))
    got = await ask(gw, wire, False)
    assert model.called[0].startswith("cmp-")
    assert result_got(model, wire) == vault_file()
    assert got.text == PREAMBLE + f"The code is {PLANTED}."
    ev = (await gw.wait_mem(1))[-1]
    assert ev["dropped"] == "0" and ev["retrieve"] == "tool"


OTHERS = ((SECRET + "-other", "s-1"), (SECRET, "s-2"))  # another tenant, another session


@pytest.mark.parametrize("tokens", [HIST, CMP], ids=["hist", "cmp"])
@pytest.mark.parametrize("wire", WIRES)
async def test_a_handle_of_another_tenant_or_session_gives_nothing(
        gateway: GatewayFactory, model: Model, wire: str, tokens: int) -> None:
    """A handle answers in the tenant and session that made it only: asked for by another
    API key or another session sending the same conversation, nothing is kept under it."""
    gw = await start(gateway, model, budget=budget(tokens))
    assert (await ask(gw, wire, False)).text.endswith(PLANTED + ".")
    own = model.called[0]
    assert own.startswith("hist-" if tokens == HIST else "cmp-")
    model.handle = own
    for key, session in OTHERS:
        got = await ask(gw, wire, False, key=key, session=session)
        asked = model.received[-2]
        assert TOOL in tool_names(wire, orjson.loads(asked))
        theirs = handles_in(asked)
        assert theirs and own not in theirs  # the same text, a handle of its own
        result = result_got(model, wire)
        assert f"nothing is kept under the handle {own!r}" in result
        assert PLANTED not in result and PLANTED not in got.text


async def test_the_archive_answers_its_own_session_only(
        gateway: GatewayFactory, model: Model, tmp_path: Path) -> None:
    """store.archive evicted (SQLite): once the client's history no longer holds the vault
    file, its compacted result's handle is answered from the archive in its own session;
    from another session or API key the same handle gives nothing."""
    wire = "openai_chat"
    gw = await start(gateway, model, budget=budget(CMP),
                     store={"path": str(tmp_path / "memgate.db"), "archive": "evicted"})
    await ask(gw, wire, False)
    own = model.called[0]
    assert own.startswith("cmp-")
    await gw.state.memory.queue.join()
    model.handle = own
    # the client cleared the old result itself; long enough to be cut
    cleared = conversation(wire, result="(cleared to save context)", n_turns=8)
    results = {}
    for key, session in ((SECRET, "s-1"), *OTHERS):
        await ask(gw, wire, False, key=key, session=session, args=cleared)
        assert TOOL in tool_names(wire, model.bodies()[-2])
        assert PLANTED.encode() not in model.received[-2]
        results[key, session] = result_got(model, wire)
    assert results[SECRET, "s-1"] == vault_file()
    for other in OTHERS:
        assert f"nothing is kept under the handle {own!r}" in results[other]


FORCED = {"openai_chat": {"type": "function", "function": {"name": "read_file"}},
          "anthropic_messages": {"type": "tool", "name": "read_file"},
          "openai_responses": {"type": "function", "name": "read_file"}}
NONE: dict[str, Any] = {"openai_chat": "none", "anthropic_messages": {"type": "none"},
                        "openai_responses": "none"}


@pytest.mark.parametrize("tokens", [HIST, CMP], ids=["hist", "cmp"])
@pytest.mark.parametrize("choice", ["forced", "none"])
@pytest.mark.parametrize("wire", WIRES)
async def test_no_marker_names_a_tool_the_request_lacks(
        gateway: GatewayFactory, model: Model, wire: str, choice: str, tokens: int) -> None:
    """tool_choice forcing the client's tool, or none: the cut request gets no retrieval
    tool, and neither the carry note nor a compacted result's marker names it."""
    gw = await start(gateway, model, budget=budget(tokens))
    tool_choice = (FORCED if choice == "forced" else NONE)[wire]
    await ask(gw, wire, False, tool_choice=tool_choice)
    (sent,) = model.received
    assert TOOL.encode() not in sent and handles_in(sent) == []
    assert orjson.loads(sent)["tool_choice"] == tool_choice
    ev = (await gw.wait_mem(1))[-1]
    assert ev["retrieve"] == "tool_choice"
    if tokens == HIST:
        assert int(ev["dropped"]) > 0 and b"earlier turns were" not in sent
    else:
        assert ev["dropped"] == "0" and b"[memgate: compacted tool result" in sent


@pytest.mark.parametrize(("wire", "stream"), PARAMS)
async def test_a_client_call_beside_memgates_goes_to_the_client_alone(
        gateway: GatewayFactory, model: Model, wire: str, stream: bool) -> None:
    """The model calls the retrieval tool and the client's read_file in one answer: the
    client gets its own call only (ours taken out, not answered) and runs it."""
    model.mixed = True
    gw = await start(gateway, model)
    got = await ask(gw, wire, stream)
    call_id = "toolu_1_1" if wire == "anthropic_messages" else "call_1_1"
    assert [(n, orjson.loads(a), i) for n, a, i in got.calls] == [
        ("read_file", {"path": "notes.txt"}, call_id)]
    assert got.text == PREAMBLE and got.stop == TOOL_STOP[wire] and TOOL not in got.dump
    assert len(model.received) == 1 and same_usage(got.usage, model.usage[0])
    ev = (await gw.wait_mem(1))[-1]
    assert ev["retrieve"] == "tool" and "retrieve_rounds" not in ev


@pytest.mark.parametrize("wire", WIRES)
async def test_the_raw_stream_numbers_the_clients_call_from_0(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """Read as raw SSE, a mixed answer's client call follows the text at the next index
    (the retrieval call before it leaves no gap) and the stream ends once."""
    model.mixed = True
    gw = await start(gateway, model)
    events = await raw_events(gw, wire)
    kinds = [k for k, _ in events]
    assert TOOL not in shown(events)
    if wire == "openai_chat":
        calls = [tc for _, v in events if v for ch in v["choices"]
                 for tc in ch["delta"].get("tool_calls") or []]
        assert calls and {tc["index"] for tc in calls} == {0}
        assert calls[0]["id"] == "call_1_1" and calls[0]["function"]["name"] == "read_file"
        assert kinds.count("[DONE]") == 1
        assert [ch["finish_reason"] for _, v in events if v for ch in v["choices"]
                if ch["finish_reason"]] == ["tool_calls"]
    elif wire == "anthropic_messages":
        starts = [(v["index"], v["content_block"]["type"]) for k, v in events
                  if k == "content_block_start"]
        assert starts == [(0, "text"), (1, "tool_use")]
        assert {v["index"] for k, v in events if k.startswith("content_block")} == {0, 1}
        assert kinds.count("message_stop") == 1
        delta = next(v for k, v in events if k == "message_delta")
        assert delta["delta"]["stop_reason"] == "tool_use"
    else:
        assert [v["output_index"] for k, v in events
                if k == "response.output_item.added"] == [0, 1]
        assert {v["output_index"] for _, v in events if "output_index" in v} == {0, 1}
        seqs = [v["sequence_number"] for _, v in events]
        assert seqs == list(range(len(seqs)))
        assert kinds.count("response.completed") == 1
        done = events[-1][1]["response"]
        assert [(i["type"], i.get("name")) for i in done["output"]] == [
            ("message", None), ("function_call", "read_file")]


@pytest.mark.parametrize(("wire", "stream"), PARAMS)
async def test_a_failed_round_ends_the_answer_so_far(
        gateway: GatewayFactory, model: Model, wire: str, stream: bool) -> None:
    """The second round gets a 500: the client gets the first round's text, ended as a
    plain end of turn, and the [mem] line says retrieve_error."""
    model.fail_from = 2
    gw = await start(gateway, model)
    got = await ask(gw, wire, stream)
    assert got.text == PREAMBLE and got.calls == [] and got.stop == END[wire]
    assert TOOL not in got.dump
    assert len(model.received) == 2 and same_usage(got.usage, model.usage[0])
    ev = (await gw.wait_mem(1))[-1]
    assert ev["status"] == "200" and ev["retrieve_error"] == "status_500"


@pytest.mark.parametrize("wire", WIRES)
async def test_a_round_answered_200_with_an_error_object_is_a_failed_round(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """Round 2 comes back 200 with an error object (no choices / content / output): the
    client still gets round 1's text as one well-formed answer, never a 500."""
    model.fail_from, model.fail_status = 2, 200
    gw = await start(gateway, model)
    got = await ask(gw, wire, False)
    assert got.text == PREAMBLE and got.calls == [] and got.stop == END[wire]
    ev = (await gw.wait_mem(1))[-1]
    assert ev["status"] == "200" and ev["retrieve_error"] == "unreadable"


@pytest.mark.parametrize(("wire", "stream"), PARAMS)
async def test_the_last_round_is_asked_without_tools(
        gateway: GatewayFactory, model: Model, wire: str, stream: bool) -> None:
    """A model that calls the tool whatever it is told: with max_rounds 2 it is asked
    three times, the last with tool_choice none; the client gets an ended answer."""
    model.always, model.obeys_none = True, False
    gw = await start(gateway, model, retrieve={**RETRIEVE, "max_rounds": 2})
    got = await ask(gw, wire, stream)
    bodies = model.bodies()
    assert [b.get("tool_choice") for b in bodies] == [None, None, NONE[wire]]
    assert got.text == PREAMBLE and got.calls == [] and got.stop == END[wire]
    assert TOOL not in got.dump
    assert same_usage(got.usage, summed(model.usage))
    ev = (await gw.wait_mem(1))[-1]
    assert ev["retrieve_rounds"] == "2" and "retrieve_error" not in ev


@pytest.mark.parametrize("wire", WIRES)
async def test_told_none_the_model_answers_on_the_last_round(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """A model that retrieves while it may: the round asked with tool_choice none gets
    its answer, which reaches the client after the first round's text (streamed)."""
    model.always = True
    gw = await start(gateway, model, retrieve={**RETRIEVE, "max_rounds": 2})
    got = await ask(gw, wire, True)
    assert len(model.received) == 3 and choice_is_none(wire, model.bodies()[-1])
    assert got.text == PREAMBLE + f"The code is {PLANTED}." and got.calls == []
    assert got.stop == END[wire] and same_usage(got.usage, summed(model.usage))


async def post(gw: Gateway, wire: str, body: dict[str, Any]) -> int:
    headers = {"Authorization": f"Bearer {SECRET}", "x-api-key": SECRET,
               "anthropic-version": "2023-06-01", "X-Session-Id": "s-1"}
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + PATHS[wire], data=orjson.dumps(body), headers=headers) as r:
        await r.read()
        return r.status


@pytest.mark.parametrize("wire", WIRES)
async def test_retrieve_off_forwards_the_bytes_of_a_config_without_it(
        gateway: GatewayFactory, model: Model, wire: str) -> None:
    """memory.retrieve.enabled false (its other keys set): every forwarded body is the
    one a config without the retrieve section forwards, byte for byte (and enabled
    true would change it)."""
    off = {"enabled": False, "tool_name": "fetch_cut", "max_rounds": 1,
           "excerpt_min_chars": 2000, "max_result_chars": 500}
    without = {k: v for k, v in MEMORY.items() if k != "retrieve"}
    sent = {}
    for name, memory in (("off", {**without, "retrieve": off}), ("absent", without),
                         ("on", MEMORY)):
        gw = await gateway(memory=memory, upstream_url=model.url)
        before = len(model.received)
        for n_turns in (3, 4):  # the session's second request reuses the first's parse
            body = {**conversation(wire, n_turns=n_turns), "model": MODEL[wire]}
            assert await post(gw, wire, body) == 200
        sent[name] = model.received[before:]
    assert len(sent["off"]) == 2 and sent["off"] == sent["absent"]
    assert TOOL.encode() not in b"".join(sent["off"])
    assert TOOL.encode() in sent["on"][0]
