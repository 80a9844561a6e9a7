"""Real SDKs through the gateway: anthropic (messages) and openai (responses)."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import orjson
import pytest

from tests.conftest import SECRET, GatewayFactory, Upstream


def long_anthropic_history(turns: int = 30) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "[PIN] Always answer in French."},
        {"role": "assistant", "content": [{"type": "text", "text": "D'accord.",
                                           "cache_control": {"type": "ephemeral"}}]},
    ]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Turn {t}: read file {t} " + "pad " * 200})
        msgs.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
            {"type": "tool_use", "id": f"toolu_{t}", "name": "read", "input": {"n": t}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": "data " * 100}]})
        msgs.append({"role": "assistant", "content": f"Read file {t}."})
    msgs.append({"role": "user", "content": "Summarise."})
    return msgs


async def test_anthropic_sdk_non_stream_with_eviction(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """anthropic SDK -> gateway: old turns dropped, pin and tool pairs kept, headers through."""
    gw = await gateway(memory={"enable_eviction": True,
                               "budget": {"max_tokens": 3000, "max_chars": None,
                                          "max_messages": None, "max_turns": None}})
    history = long_anthropic_history()
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        msg = await c.messages.create(
            model="claude-3-5-haiku-20241022", max_tokens=100, system="Be brief.",
            messages=history, extra_headers={"anthropic-beta": "test-beta"})
    assert msg.content[0].text == "Hello from Claude"
    got = upstream.received[-1]
    assert got["path"] == "/v1/messages"
    # the SDK's credential header (x-api-key, or Authorization in newer SDKs) passes through
    assert SECRET in (got["headers"].get("x-api-key"), got["headers"].get("Authorization", "")[7:])
    assert got["headers"]["anthropic-version"]
    assert got["headers"]["anthropic-beta"] == "test-beta"
    body = orjson.loads(got["raw"])
    assert body["system"] == "Be brief."
    msgs = body["messages"]
    assert len(msgs) < len(history)
    assert msgs[0] == history[0]  # the pin
    uses = {b["id"] for m in msgs if isinstance(m["content"], list) for b in m["content"]
            if b["type"] == "tool_use"}
    results = {b["tool_use_id"] for m in msgs if isinstance(m["content"], list)
               for b in m["content"] if b["type"] == "tool_result"}
    assert uses == results and uses
    assert all(b["type"] != "tool_use" or m["content"][0]["type"] == "thinking"
               for m in msgs if isinstance(m["content"], list) for b in m["content"])
    ev = gw.mem_events()[-1]
    assert ev["api"] == "anthropic_messages" and ev["tokenizer"] == "approx"
    assert ev["cache_marker_dropped"] == "true"
    assert int(ev["dropped"]) == len(history) - len(msgs)


async def test_anthropic_cache_marker_moved_when_configured(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """move_cache_marker: the dropped breakpoint is re-placed at the end of the stable prefix."""
    gw = await gateway(memory={"enable_eviction": True,
                               "budget": {"max_tokens": 3000, "max_chars": None,
                                          "max_messages": None, "max_turns": None},
                               "eviction": {"move_cache_marker": True}})
    history = long_anthropic_history()
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=100,
                                messages=history)
    msgs = orjson.loads(upstream.received[-1]["raw"])["messages"]
    marked = [i for i, m in enumerate(msgs) if isinstance(m["content"], list)
              and any("cache_control" in b for b in m["content"])]
    ev = gw.mem_events()[-1]
    # the last message before the current turn and the history recalled for its question
    recalled = int(ev.get("recalled", 0))
    assert marked == [len(msgs) - 2 - recalled]
    assert ev["cache_marker"] == "moved"


def breakpoint_ttls(msgs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(i, b["cache_control"].get("ttl", "5m")) for i, m in enumerate(msgs)
            if isinstance(m["content"], list) for b in m["content"] if "cache_control" in b]


@pytest.mark.parametrize("case", ["dropped 1h", "target marked"])
async def test_anthropic_moved_marker_keeps_the_lifetimes_valid(
    gateway: GatewayFactory, upstream: Upstream, case: str
) -> None:
    """The re-placed breakpoint lives as long as the dropped one (1h), never overwrites
    one the client put on the target, and the forwarded lifetimes stay in the order
    Anthropic requires (1-hour entries before 5-minute ones)."""
    gw = await gateway(memory={"enable_eviction": True,
                               "budget": {"max_tokens": 3000, "max_chars": None,
                                          "max_messages": None, "max_turns": None},
                               "eviction": {"move_cache_marker": True, "recall_share": 0.0}})
    history = long_anthropic_history()
    history[1]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    history[-1] = {"role": "user", "content": [{"type": "text", "text": "Summarise.",
                                                "cache_control": {"type": "ephemeral",
                                                                  "ttl": "1h"}}]}
    if case == "target marked":  # the last reply before the current turn: a 5m breakpoint
        history[-2] = {"role": "assistant", "content": [
            {"type": "text", "text": "Read file 29.", "cache_control": {"type": "ephemeral"}}]}
        history[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=100,
                                messages=history)
    msgs = orjson.loads(upstream.received[-1]["raw"])["messages"]
    ev = gw.mem_events()[-1]
    ttls = [t for _, t in breakpoint_ttls(msgs)]
    assert "1h" not in ttls[ttls.index("5m"):] if "5m" in ttls else True, ttls
    if case == "dropped 1h":
        assert breakpoint_ttls(msgs) == [(len(msgs) - 2, "1h"), (len(msgs) - 1, "1h")]
        assert ev["cache_marker"] == "moved"
    else:  # the client's breakpoints as sent, nothing added
        assert msgs[-2:] == history[-2:]
        assert ttls == ["5m", "5m"] and ev.get("cache_marker") != "moved"


async def test_anthropic_sdk_stream(gateway: GatewayFactory, upstream: Upstream) -> None:
    """SSE events (message_start, content_block_delta, ...) reach the SDK's stream parser."""
    gw = await gateway()
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        async with c.messages.stream(model="claude-3-5-haiku-20241022", max_tokens=50,
                                     messages=[{"role": "user", "content": "hi"}]) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
    assert "".join(texts).strip() == "Hello from Claude"
    assert final.stop_reason == "end_turn"


async def test_anthropic_gateway_error_shape(gateway: GatewayFactory) -> None:
    """A gateway error on /v1/messages uses Anthropic's error shape, parsed by the SDK."""
    gw = await gateway(upstream_url="http://127.0.0.1:9")
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        try:
            await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=10,
                                    messages=[{"role": "user", "content": "hi"}])
        except anthropic.APIStatusError as exc:
            assert exc.status_code == 502
            assert exc.body["type"] == "error"
            assert exc.body["error"]["type"] == "api_error"
            assert "unreachable" in exc.body["error"]["message"]
        else:
            raise AssertionError("expected a 502")


async def test_openai_responses_non_stream_and_stream(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """openai SDK responses.create (plain and streamed) through the gateway with eviction."""
    gw = await gateway(memory={"enable_eviction": True,
                               "budget": {"max_tokens": 800, "max_chars": None,
                                          "max_messages": None, "max_turns": None}})
    items: list[dict[str, Any]] = [{"role": "user", "content": "[PIN] Use metric units."}]
    for t in range(20):
        items += [
            {"role": "user", "content": f"step {t} " + "pad " * 50},
            {"type": "reasoning", "id": f"rs_{t}", "summary": []},
            {"type": "function_call", "call_id": f"call_{t}", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": f"call_{t}", "output": "ok " * 30},
            {"role": "assistant", "content": f"done {t}"},
        ]
    items.append({"role": "user", "content": "What now?"})
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as c:
        resp = await c.responses.create(model="gpt-4o-mini", instructions="Be brief.",
                                        input=items)
        assert resp.output_text == "Hello from responses"
        body = orjson.loads(upstream.received[-1]["raw"])
        got = body["input"]
        assert body["instructions"] == "Be brief."
        assert got[0] == items[0] and got[-1] == items[-1] and len(got) < len(items)
        calls = {i["call_id"] for i in got if i.get("type") == "function_call"}
        outs = {i["call_id"] for i in got if i.get("type") == "function_call_output"}
        assert calls == outs and calls
        deltas = []
        stream = await c.responses.create(model="gpt-4o-mini", input=items, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        assert "".join(deltas).strip() == "Hello from responses"
    ev = gw.mem_events()[-1]
    assert ev["api"] == "openai_responses" and int(ev["dropped"]) > 0
