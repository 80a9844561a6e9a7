"""Kept messages are forwarded byte for byte: the rewritten body is cut from the client's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import GatewayFactory, Upstream
from .test_proxy import post_raw

BIG = 123456789012345678901234567893  # past 64 bits: orjson reads it as a float
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}
EVICTING = {"enable_eviction": True, "budget": {"max_messages": 6}}


def history(api: str, turns: int = 8) -> dict[str, Any]:
    """A body of `api` with `turns` turns; every message holds a 30-digit integer and
    non-ASCII text (written escaped by json.dumps)."""
    items: list[dict[str, Any]] = []
    for t in range(turns):
        ask = f"turn {t}: caf\u00e9 cr\u00e8me, order {BIG + t}?"
        if api == "messages":
            items.append({"role": "user", "content": [{"type": "text", "text": ask}]})
            items.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": f"toolu_{t}", "name": "lookup",
                 "input": {"order_id": BIG + t, "note": "d\u00e9j\u00e0"}}]})
            items.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{t}", "content": "pr\u00eat"}]})
            items.append({"role": "assistant", "content": [{"type": "text", "text": "ok \u00e9"}]})
        elif api == "responses":
            items.append({"type": "message", "role": "user", "content": ask, "seq": BIG + t})
            items.append({"type": "function_call", "call_id": f"c{t}", "name": "lookup",
                          "arguments": json.dumps({"order_id": BIG + t})})
            items.append({"type": "function_call_output", "call_id": f"c{t}",
                          "output": "pr\u00eat", "seq": BIG})
            items.append({"type": "message", "role": "assistant", "content": "ok \u00e9"})
        else:
            items.append({"role": "user", "content": ask, "seq": BIG + t})
            items.append({"role": "assistant", "content": "ok \u00e9", "seq": -BIG - t})
    items.append({"role": "user", "content": f"and now? \u00e9 {BIG}", "seq": BIG})
    key = "input" if api == "responses" else "messages"
    return {"model": "claude-3-5-haiku-20241022" if api == "messages" else "gpt-4o-mini",
            "max_tokens": 100, key: items, "metadata": {"trace": BIG}}


@pytest.mark.parametrize("api", sorted(PATHS))
async def test_big_ints_and_escapes_reach_upstream_unchanged(
    gateway: GatewayFactory, upstream: Upstream, api: str
) -> None:
    """Eviction on, 30-digit integers and \\u00e9 escapes in kept messages: the upstream
    receives each kept message's exact bytes and the top-level fields untouched."""
    gw = await gateway(memory=EVICTING)
    body = history(api)
    key = "input" if api == "responses" else "messages"
    raw = json.dumps(body).encode()  # ", " / ": " separators, ASCII with \u escapes
    status, _, _ = await post_raw(gw, raw, PATHS[api])
    assert status == 200
    fwd = upstream.received[-1]["raw"]
    ev = (await gw.wait_mem(1))[-1]
    assert ev["evict"] != "none" and int(ev["dropped"]) > 0, ev
    sent = json.loads(fwd)[key]  # the stdlib keeps big integers exact
    assert 0 < len(sent) < len(body[key]) and sent[-1] == body[key][-1]
    pos = 0
    for item in sent:
        own = json.dumps(item).encode()
        assert own in raw and own in fwd  # the client's bytes of that item, verbatim
        pos = body[key].index(item, pos) + 1  # in the client's order
    assert b'"metadata": {"trace": %d}' % BIG in fwd
    assert fwd.startswith(raw[: raw.index(b"[")])  # what precedes the list is untouched


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def deepened(api: str, depth: int, where: str) -> tuple[bytes, bytes]:
    """A history body with a value nested `depth` deep in the last message (`item`: a
    field of its own, `content`: inside a content part) or in the first user message's
    content (`first`); (the body, that message's bytes)."""
    body = history(api)
    key = "input" if api == "responses" else "messages"
    at = 0 if where == "first" else -1
    msg = body[key][at]
    if where != "item":
        text = msg["content"] if isinstance(msg["content"], str) else msg["content"][0]["text"]
        part = "input_text" if api == "responses" else "text"
        msg["content"] = [{"type": part, "text": text, "deep": "HERE"}]
    else:
        msg["deep"] = "HERE"
    raw = json.dumps(body).encode()
    own = json.dumps(msg).encode()
    deep = own.replace(b'"HERE"', nested(depth))
    return raw.replace(own, deep), deep


@pytest.mark.parametrize("where", ["item", "content", "first"])
@pytest.mark.parametrize("depth", [300, 1000])
@pytest.mark.parametrize("api", sorted(PATHS))
async def test_deep_nesting_in_a_rewritten_body_is_no_500(
    gateway: GatewayFactory, upstream: Upstream, api: str, depth: int, where: str
) -> None:
    """A message nested deeper than orjson writes (255..1024 levels) in a body that
    eviction rewrites: its bytes forwarded as sent (evicted around, or the whole body
    relayed with evict=skipped), with a [mem] line, never a bare 500."""
    gw = await gateway(memory=EVICTING)
    raw, deep = deepened(api, depth, where)
    status, answer, _ = await post_raw(gw, raw, PATHS[api])
    assert status == 200, answer
    fwd = upstream.received[-1]["raw"]
    ev = (await gw.wait_mem(1))[-1]
    if ev["evict"] == "skipped":
        assert fwd == raw and ev["reason"] == "nested_too_deep"
    else:
        assert int(ev["dropped"]) > 0 and len(fwd) < len(raw)
        assert deep in fwd or where == "first"


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_message_whose_role_is_an_object_is_no_500(
    gateway: GatewayFactory, upstream: Upstream, api: str
) -> None:
    """A message whose role is an object is relayed as sent (the planner cannot read it:
    evict=skipped), not a 500."""
    gw = await gateway(memory=EVICTING)
    body = history(api)
    body["input" if api == "responses" else "messages"][4]["role"] = {"name": "user"}
    raw = json.dumps(body).encode()
    status, _, _ = await post_raw(gw, raw, PATHS[api])
    assert status == 200
    assert upstream.received[-1]["raw"] == raw
    ev = (await gw.wait_mem(1))[-1]
    assert ev["evict"] == "skipped"
    assert ev["reason"] == {"chat": "missing_role", "responses": "unknown_role"}[api]
