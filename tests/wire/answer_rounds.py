"""Upstream answers for the retrieval loop's tests: one round's parts (text, thinking,
calls) as each wire's non-streaming answer and as its event stream, the way the APIs
send them (the shapes read from the SDKs' types), plus hypothesis generators of rounds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from hypothesis import strategies as st

OURS = "memgate_retrieve"
CLIENT_TOOLS = ("read_file", "memgate_retrieve_more")  # the second holds our name in it
WORDS = ["the", "order", "订单", "汇总", "é", "ok", " ", "line\n", "quote\"", "emoji 🙂"]


@dataclass
class Part:
    kind: str  # text | thinking | client | ours
    pieces: list[str]  # text deltas, or the arguments' JSON in pieces
    name: str = ""  # the tool called
    id: str = ""  # the call's id


@dataclass
class Spec:
    """One round as the upstream answers it."""

    n: int  # the round's number, for ids
    parts: list[Part]
    usage: tuple[int, int, int, int]  # input, output, cache read, cache write
    extra: dict[str, Any] = field(default_factory=dict)

    def calls(self) -> list[Part]:
        return [p for p in self.parts if p.kind in ("client", "ours")]

    def ours(self) -> list[Part]:
        return [p for p in self.parts if p.kind == "ours"]


def _text(p: Part) -> str:
    return "".join(p.pieces)


def _event(value: dict[str, Any], named: bool = True) -> bytes:
    head = b"event: " + value["type"].encode() + b"\n" if named else b""
    return head + b"data: " + orjson.dumps(value) + b"\n\n"


# chat completions ---------------------------------------------------------------------

def chat_round(spec: Spec, include_usage: bool) -> tuple[dict[str, Any], bytes]:
    """(the non-streaming answer, the stream) of one round; thinking is not a chat part."""
    parts = [p for p in spec.parts if p.kind != "thinking"]
    head = {"id": f"chatcmpl-{spec.n}", "created": 1700000000 + spec.n, "model": "gpt-4o",
            "system_fingerprint": "fp_1"}
    calls = [p for p in parts if p.kind in ("client", "ours")]
    finish = "tool_calls" if calls else "stop"
    i, o, cr, _ = spec.usage
    usage = {"prompt_tokens": i, "completion_tokens": o, "total_tokens": i + o,
             "prompt_tokens_details": {"cached_tokens": cr},
             "completion_tokens_details": {"reasoning_tokens": o // 2}}
    text = "".join(_text(p) for p in parts if p.kind == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text or None, "refusal": None}
    if calls:
        message["tool_calls"] = [{"id": p.id, "type": "function",
                                  "function": {"name": p.name, "arguments": _text(p)}}
                                 for p in calls]
    answer = {**head, "object": "chat.completion", "usage": usage, "choices": [
        {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        value = {**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if include_usage:
            value["usage"] = None
        return _event(value, named=False)

    out = [chunk({"role": "assistant", "content": "", "refusal": None})]
    index = 0
    for p in parts:
        if p.kind == "text":
            out += [chunk({"content": piece}) for piece in p.pieces]
            continue
        out.append(chunk({"tool_calls": [{"index": index, "id": p.id, "type": "function",
                                          "function": {"name": p.name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                for piece in p.pieces]
        index += 1
    out.append(chunk({}, finish))
    if include_usage:
        out.append(_event({**head, "object": "chat.completion.chunk", "choices": [],
                           "usage": usage}, named=False))
    out.append(b"data: [DONE]\n\n")
    return answer, b"".join(out)


# Anthropic messages -------------------------------------------------------------------

def anthropic_round(spec: Spec) -> tuple[dict[str, Any], bytes]:
    i, o, cr, cw = spec.usage
    blocks: list[dict[str, Any]] = []
    for j, p in enumerate(spec.parts):
        if p.kind == "text":
            blocks.append({"type": "text", "text": _text(p)})
        elif p.kind == "thinking":
            blocks.append({"type": "thinking", "thinking": _text(p),
                           "signature": f"sig-{spec.n}-{j}"})
        else:
            blocks.append({"type": "tool_use", "id": p.id, "name": p.name,
                           "input": orjson.loads(_text(p))})
    stop = "tool_use" if spec.calls() else "end_turn"
    usage = {"input_tokens": i, "output_tokens": o, "cache_creation_input_tokens": cw,
             "cache_read_input_tokens": cr}
    head = {"id": f"msg_{spec.n}", "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-5"}
    answer = {**head, "content": blocks, "stop_reason": stop, "stop_sequence": None,
              "usage": usage}
    out = [_event({"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1}}}), _event({"type": "ping"})]
    for j, (p, block) in enumerate(zip(spec.parts, blocks)):
        if p.kind == "text":
            start: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": piece} for piece in p.pieces]
        elif p.kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": piece} for piece in p.pieces]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            start = {"type": "tool_use", "id": p.id, "name": p.name, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": piece}
                      for piece in p.pieces]
        out.append(_event({"type": "content_block_start", "index": j, "content_block": start}))
        out += [_event({"type": "content_block_delta", "index": j, "delta": d})
                for d in deltas]
        out.append(_event({"type": "content_block_stop", "index": j}))
    out.append(_event({"type": "message_delta",
                       "delta": {"stop_reason": stop, "stop_sequence": None},
                       "usage": {"output_tokens": o}}))
    out.append(_event({"type": "message_stop"}))
    return answer, b"".join(out)


# OpenAI Responses ---------------------------------------------------------------------

def responses_round(spec: Spec) -> tuple[dict[str, Any], bytes]:
    i, o, cr, cw = spec.usage
    items: list[dict[str, Any]] = []
    for j, p in enumerate(spec.parts):
        item_id = f"{p.kind}_{spec.n}_{j}"
        if p.kind == "text":
            items.append({"id": item_id, "type": "message", "role": "assistant",
                          "status": "completed", "content": [
                              {"type": "output_text", "text": _text(p), "annotations": [],
                               "logprobs": []}]})
        elif p.kind == "thinking":
            items.append({"id": item_id, "type": "reasoning",
                          "summary": [{"type": "summary_text", "text": _text(p)}]})
        else:
            items.append({"id": item_id, "type": "function_call", "call_id": p.id,
                          "name": p.name, "arguments": _text(p), "status": "completed"})
    usage = {"input_tokens": i,
             "input_tokens_details": {"cached_tokens": cr, "cache_write_tokens": cw},
             "output_tokens": o, "output_tokens_details": {"reasoning_tokens": o // 2},
             "total_tokens": i + o}
    head = {"id": f"resp_{spec.n}", "object": "response", "created_at": 1700000000 + spec.n,
            "model": "gpt-5", "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "error": None, "incomplete_details": None}
    answer = {**head, "status": "completed", "output": items, "usage": usage}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**head, "status": "in_progress",
                                                  "output": [], "usage": None}},
        {"type": "response.in_progress", "response": {**head, "status": "in_progress",
                                                      "output": [], "usage": None}}]
    for j, (p, item) in enumerate(zip(spec.parts, items)):
        at = {"item_id": item["id"], "output_index": j}
        if p.kind == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append({"type": "response.output_item.added", "output_index": j,
                           "item": {**item, "status": "in_progress", "content": []}})
            events.append({"type": "response.content_part.added", **at, "content_index": 0,
                           "part": part})
            events += [{"type": "response.output_text.delta", **at, "content_index": 0,
                        "delta": piece, "logprobs": []} for piece in p.pieces]
            events.append({"type": "response.output_text.done", **at, "content_index": 0,
                           "text": _text(p), "logprobs": []})
            events.append({"type": "response.content_part.done", **at, "content_index": 0,
                           "part": item["content"][0]})
        elif p.kind == "thinking":
            part = {"type": "summary_text", "text": ""}
            events.append({"type": "response.output_item.added", "output_index": j,
                           "item": {**item, "summary": []}})
            events.append({"type": "response.reasoning_summary_part.added", **at,
                           "summary_index": 0, "part": part})
            events += [{"type": "response.reasoning_summary_text.delta", **at,
                        "summary_index": 0, "delta": piece} for piece in p.pieces]
            events.append({"type": "response.reasoning_summary_text.done", **at,
                           "summary_index": 0, "text": _text(p)})
            events.append({"type": "response.reasoning_summary_part.done", **at,
                           "summary_index": 0, "part": item["summary"][0]})
        else:
            events.append({"type": "response.output_item.added", "output_index": j,
                           "item": {**item, "arguments": "", "status": "in_progress"}})
            events += [{"type": "response.function_call_arguments.delta", **at,
                        "delta": piece} for piece in p.pieces]
            events.append({"type": "response.function_call_arguments.done", **at,
                           "arguments": _text(p)})
        events.append({"type": "response.output_item.done", "output_index": j, "item": item})
    events.append({"type": "response.completed", "response": answer})
    return answer, b"".join(_event({**e, "sequence_number": k}) for k, e in enumerate(events))


# generators ---------------------------------------------------------------------------

@st.composite
def pieces(draw: st.DrawFn, text: str | None = None) -> list[str]:
    """A text (drawn, or `text`) in 1-3 pieces, as a model streams it."""
    if text is None:
        text = "".join(draw(st.lists(st.sampled_from(WORDS), max_size=6)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=2)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def part(draw: st.DrawFn, kind: str, n: int, j: int) -> Part:
    if kind in ("text", "thinking"):
        return Part(kind, draw(pieces()))
    args = orjson.dumps({"query": "".join(draw(st.lists(st.sampled_from(WORDS),
                                                        max_size=3)))}).decode()
    name = OURS if kind == "ours" else draw(st.sampled_from(CLIENT_TOOLS))
    return Part(kind, draw(pieces(args)), name, f"call_{kind}_{n}_{j}")


@st.composite
def rounds(draw: st.DrawFn) -> list[Spec]:
    """1-3 rounds: every round but the last calls the retrieval tool; the last may."""
    count = draw(st.integers(1, 3))
    out = []
    for n in range(1, count + 1):
        kinds = draw(st.lists(st.sampled_from(["text", "thinking", "client"]), max_size=3))
        if n < count or draw(st.booleans()):
            for _ in range(draw(st.integers(1, 2))):
                kinds.insert(draw(st.integers(0, len(kinds))), "ours")
        parts = [draw(part(k, n, j)) for j, k in enumerate(kinds)]
        usage = draw(st.tuples(*[st.integers(0, 5000)] * 4))
        out.append(Spec(n, parts, usage))
    return out
