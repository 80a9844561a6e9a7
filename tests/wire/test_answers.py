"""The retrieval loop's answers (gateway.wire.answers*): rounds read and merged into the
client's one answer, non-streaming and streaming, checked against the real SDKs'
accumulators (openai's ChatCompletionStreamState and ResponseStreamState, anthropic's
accumulate_event)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.wire.answers import Answers, Round, event_fields, take_events, usage_sum
from gateway.wire.answers_by_wire import ANSWERS
from tests.wire.answer_rounds import (
    OURS,
    Part,
    Spec,
    anthropic_round,
    chat_round,
    responses_round,
    rounds,
)

CHAT, MESSAGES, RESPONSES = (ANSWERS[w] for w in ("openai_chat", "anthropic_messages",
                                                  "openai_responses"))
ANTHROPIC_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
PROPERTY = settings(max_examples=60, deadline=None)


def events(body: bytes) -> list[tuple[str, dict[str, Any] | str]]:
    """The client's events: (type, data as JSON, or the data's text when it is not)."""
    out: list[tuple[str, dict[str, Any] | str]] = []
    for raw in take_events(bytearray(body)):
        kind, data = event_fields(raw)
        out.append((kind, data.decode() if data == b"[DONE]" else orjson.loads(data)))
    return out


def run(api: Answers, streams: list[bytes], cuts: list[list[int]] | None, end: bool
        ) -> tuple[bytes, list[Round | None]]:
    """The client's bytes of the rounds' streams (each fed whole, or cut at `cuts`) and
    what round_end said of each round, the way the proxy's loop drives a StreamMerge."""
    merge = api.stream(OURS)
    out: list[bytes] = []
    seen: list[Round | None] = []
    for k, body in enumerate(streams):
        if k:
            merge.next_round()
        bounds = [0, *sorted(set(cuts[k])), len(body)] if cuts else [0, len(body)]
        out += [merge.feed(body[a:b]) for a, b in zip(bounds, bounds[1:])]
        seen.append(merge.round_end())
        if seen[-1] is None:
            assert merge.finish(end) == b"", "a stream that ended has nothing more"
            break
        if k == len(streams) - 1:
            out.append(merge.finish(end))
            assert merge.finish(end) == b"", "the end comes once"
    return b"".join(out), seen


def cut_points(data: st.DataObject, streams: list[bytes]) -> list[list[int]]:
    return [data.draw(st.lists(st.integers(1, max(1, len(b) - 1)), max_size=12))
            for b in streams]


def check_common(api: Answers, specs: list[Spec], answers: list[dict[str, Any]],
                 streams: list[bytes], data: st.DataObject) -> tuple[bytes, bool]:
    """What holds on every wire: the same bytes however the streams are cut; each round's
    Round as `read` says of its non-streaming answer; our calls nowhere; a lone round
    without our call relayed byte for byte. Returns the client's bytes and `end`."""
    end = data.draw(st.booleans()) if specs[-1].ours() else False
    whole, seen = run(api, streams, None, end)
    cut, _ = run(api, streams, cut_points(data, streams), end)
    assert cut == whole, "the client's bytes do not depend on how the upstream's were cut"
    assert len(seen) == len(specs)
    for spec, answer, got in zip(specs, answers, seen):
        if spec.ours():
            assert got == api.read(answer, OURS)
            assert [c.id for c in got.ours] == [p.id for p in spec.ours()]
        else:
            assert got is None
    assert f'"{OURS}"'.encode() not in whole
    for p in (p for s in specs for p in s.ours()):
        assert p.id.encode() not in whole
    if len(specs) == 1 and not specs[0].ours():
        assert whole == streams[0]
    return whole, end


@given(rounds(), st.booleans(), st.data())
@PROPERTY
def test_chat_stream_is_the_merged_answer(specs: list[Spec], include_usage: bool,
                                          data: st.DataObject) -> None:
    """Chat: the merged chunk stream, accumulated by openai's ChatCompletionStreamState,
    is `merge` of the same rounds; one id, one role, call indices from 0 without gaps,
    one [DONE] last, one summed usage chunk only when the upstream sent usage."""
    built = [chat_round(s, include_usage) for s in specs]
    answers, streams = [a for a, _ in built], [b for _, b in built]
    for answer in answers if not include_usage else []:  # as the stream has it: none
        del answer["usage"]
    body, end = check_common(CHAT, specs, answers, streams, data)
    merged = CHAT.merge(answers, OURS, end)
    ChatCompletion.model_validate(merged)
    got = events(body)
    assert [d for _, d in got].count("[DONE]") == 1 and got[-1][1] == "[DONE]"
    chunks = [d for _, d in got[:-1] if isinstance(d, dict)]
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    snap = state.current_completion_snapshot
    assert {(c["id"], c["created"]) for c in chunks} == {(merged["id"], merged["created"])}
    assert sum("role" in d["delta"] for c in chunks for d in c["choices"]) == 1
    firsts = [t["index"] for c in chunks for d in c["choices"]
              for t in d["delta"].get("tool_calls", []) if "id" in t]
    assert firsts == list(range(len(firsts)))
    message, choice = merged["choices"][0]["message"], snap.choices[0]
    assert choice.message.role == "assistant"
    assert (choice.message.content or None) == message["content"]
    assert [(t.id, t.function.name, t.function.arguments)
            for t in choice.message.tool_calls or []] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"])
        for t in message.get("tool_calls", [])]
    assert choice.finish_reason == merged["choices"][0]["finish_reason"]
    assert sum(c.get("usage") is not None for c in chunks) == include_usage
    if include_usage:
        assert snap.usage is not None
        assert snap.usage.model_dump(exclude_unset=True) == merged["usage"]


def _block(b: Any) -> dict[str, Any]:
    keys = {"text": ("text",), "thinking": ("thinking", "signature"),
            "tool_use": ("id", "name", "input")}[b["type"]]
    return {"type": b["type"], **{k: b[k] for k in keys}}


@given(rounds(), st.data())
@PROPERTY
def test_anthropic_stream_is_the_merged_answer(specs: list[Spec], data: st.DataObject
                                               ) -> None:
    """Anthropic: the merged event stream, accumulated by anthropic's accumulate_event,
    is `merge` of the same rounds (blocks, stop reason, summed input, cache and output
    tokens); one message_start first, one message_delta, one message_stop last, block
    indices from 0 without gaps."""
    built = [anthropic_round(s) for s in specs]
    answers, streams = [a for a, _ in built], [b for _, b in built]
    body, end = check_common(MESSAGES, specs, answers, streams, data)
    merged = MESSAGES.merge(answers, OURS, end)
    Message.model_validate(merged)
    got = [(k, d) for k, d in events(body) if k != "ping"]
    kinds = [k for k, _ in got]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [kinds.count(k) for k in ("message_start", "message_delta", "message_stop")
            ] == [1, 1, 1]
    starts = [d["index"] for k, d in got if k == "content_block_start" and isinstance(d, dict)]
    assert starts == list(range(len(starts)))
    snap = None
    bufs: dict[int, bytes] = {}
    for kind, value in got:
        assert isinstance(value, dict) and value["type"] == kind
        snap = accumulate_event(event=ANTHROPIC_EVENT.validate_python(value),
                                current_snapshot=snap, json_bufs=bufs)
    assert snap is not None
    assert snap.id == merged["id"]
    assert [_block(b.model_dump()) for b in snap.content] == list(map(_block,
                                                                      merged["content"]))
    assert snap.stop_reason == merged["stop_reason"]
    usage = snap.usage.model_dump()
    assert {k: usage[k] for k in merged["usage"]} == merged["usage"]


@given(rounds(), st.data())
@PROPERTY
def test_responses_stream_is_the_merged_answer(specs: list[Spec], data: st.DataObject
                                               ) -> None:
    """Responses: every merged event parses as a ResponseStreamEvent and goes through
    openai's ResponseStreamState; its response.completed is `merge` of the same rounds;
    one response.created first, one terminal last, sequence numbers 0.. without gaps,
    output indices from 0 without gaps, round 1's response id throughout."""
    built = [responses_round(s) for s in specs]
    answers, streams = [a for a, _ in built], [b for _, b in built]
    body, end = check_common(RESPONSES, specs, answers, streams, data)
    merged = RESPONSES.merge(answers, OURS, end)
    Response.model_validate(merged)
    got = [d for _, d in events(body) if isinstance(d, dict)]
    kinds = [d["type"] for d in got]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds.count("response.created") == kinds.count("response.in_progress") == 1
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    assert [d["sequence_number"] for d in got] == list(range(len(got)))
    added = [d["output_index"] for d in got if d["type"] == "response.output_item.added"]
    assert added == list(range(len(added)))
    assert {d["response"]["id"] for d in got if "response" in d} == {merged["id"]}
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for kind, value in events(body):
        assert isinstance(value, dict) and value["type"] == kind
        state.handle_event(RESPONSES_EVENT.validate_python(value))
    final = got[-1]["response"]
    for k in ("id", "created_at", "status", "output", "usage"):
        assert final[k] == merged[k], k


def test_usage_sum_adds_every_number() -> None:
    """Numbers add, nested ones too, a missing side counts as nothing, other values stay
    the first's."""
    a = {"input_tokens": 3, "cache_creation": {"ephemeral_5m_input_tokens": 2},
         "service_tier": "standard", "cache_read_input_tokens": None}
    b = {"input_tokens": 4, "cache_creation": {"ephemeral_5m_input_tokens": 5,
                                               "ephemeral_1h_input_tokens": 1},
         "service_tier": "priority", "cache_read_input_tokens": 7, "output_tokens": 9}
    assert usage_sum(a, b) == {
        "input_tokens": 7, "cache_creation": {"ephemeral_5m_input_tokens": 7,
                                              "ephemeral_1h_input_tokens": 1},
        "service_tier": "standard", "cache_read_input_tokens": 7, "output_tokens": 9}
    assert usage_sum(None, b) == b and usage_sum(None, b) is not b
    assert usage_sum(None, None) is None


BUILD = {"openai_chat": lambda s: chat_round(s, True), "anthropic_messages": anthropic_round,
         "openai_responses": responses_round}
CALL = Part("ours", ['{"query":', '"x"}'], OURS, "call_ours_1_1")
TEXT = Part("text", ["订单 ", "done"])


@pytest.mark.parametrize("wire", sorted(ANSWERS))
@pytest.mark.parametrize("tool", ["read_file", "memgate_retrieve_more"])
def test_round_without_our_call_is_relayed_chunk_for_chunk(wire: str, tool: str) -> None:
    """A round that never calls the tool: each whole-event chunk comes back unchanged,
    also when a tool's name holds ours (the stream is read then, and left as it is)."""
    _, body = BUILD[wire](Spec(1, [TEXT, Part("client", ['{"a":1}'], tool, "call_c")],
                               (5, 6, 0, 0)))
    merge = ANSWERS[wire].stream(OURS)
    for raw in take_events(bytearray(body)):
        assert merge.feed(raw) == raw
    assert merge.round_end() is None
    assert merge.finish(True) == b""


@pytest.mark.parametrize("wire", sorted(ANSWERS))
def test_round_broken_off_leaves_the_client_stream_unended(wire: str) -> None:
    """A later round whose stream stops before its end: no round, and no made-up end."""
    _, first = BUILD[wire](Spec(1, [TEXT, CALL], (5, 6, 0, 0)))
    _, second = BUILD[wire](Spec(2, [TEXT], (5, 6, 0, 0)))
    merge = ANSWERS[wire].stream(OURS)
    merge.feed(first)
    assert merge.round_end() is not None
    merge.next_round()
    merge.feed(second[: len(second) // 2])
    assert merge.round_end() is None
    assert merge.finish(True) == b""


@pytest.mark.parametrize("wire", sorted(ANSWERS))
@pytest.mark.parametrize("opened", [False, True])
def test_finish_before_the_next_round_shows_ends_the_turn(wire: str, opened: bool) -> None:
    """The next round never came (its request failed) or broke off after its opening
    event only (dropped): finish(end=True) still gives the client a plain end of turn
    with the usage reported so far (Anthropic's message_start already counts input)."""
    _, first = BUILD[wire](Spec(1, [TEXT, CALL], (5, 6, 0, 0)))
    _, second = BUILD[wire](Spec(2, [TEXT], (5, 6, 0, 0)))
    merge = ANSWERS[wire].stream(OURS)
    body = merge.feed(first)
    assert merge.round_end() is not None
    merge.next_round()
    if opened:
        assert merge.feed(take_events(bytearray(second))[0]) == b""
    end = events(body + merge.finish(end=True))[-2:]
    if wire == "openai_chat":
        assert end[-1][1] == "[DONE]"
    elif wire == "anthropic_messages":
        assert [k for k, _ in end] == ["message_delta", "message_stop"]
        assert isinstance(end[0][1], dict) and end[0][1]["delta"]["stop_reason"] == "end_turn"
        assert end[0][1]["usage"]["input_tokens"] == (10 if opened else 5)
    else:
        assert isinstance(end[-1][1], dict) and end[-1][1]["response"]["status"] == "completed"
        assert end[-1][1]["response"]["usage"]["input_tokens"] == 5
