"""Faults and bad input: never a 500 from a gateway bug, never a half-done result."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.rules import load_rules
from gateway.decide.chat import decide
from gateway.errors import GatewayError, RulesError
from gateway.measure.tokens import Tokenizers
from gateway.wire import WIRES
from tests.conftest import SECRET, GatewayFactory, Upstream, sample

ROOT = Path(__file__).resolve().parents[2]
RULES = load_rules(ROOT / "rules" / "gateway.yaml", {"MEMGATE_ENABLE_EVICTION": "1"})
TOK = Tokenizers(10_000)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["role", "content", "messages", "tool_calls", "tool_call_id", "id",
                         "type", "text", "memgate", "pin", "score", "ttl", "input", "system",
                         "call_id", "name", "x"]), inner, max_size=6),
    max_leaves=30,
)


@given(body=json_values, api=st.sampled_from(sorted(WIRES)))
def test_parsers_never_crash_on_any_json(body: Any, api: str) -> None:
    """Whatever JSON arrives: a decision (forward, maybe skipped) or a clear gateway error."""
    raw = orjson.dumps(body)
    try:
        d = decide(raw, body, RULES, TOK, WIRES[api])
    except GatewayError as exc:
        assert 400 <= exc.status < 500 and exc.message
        return
    if d.skip_reason is not None:
        assert d.forward is raw  # what the gateway does not understand goes through untouched
    d.est_tokens()
    d.hist_chars()


@given(data=st.data())
def test_broken_config_is_refused_not_crashed(tmp_path_factory: Any, data: Any) -> None:
    """Truncated or mangled YAML, wrong types, unknown keys: RulesError, never a crash."""
    text = (ROOT / "rules" / "gateway.yaml").read_text()
    cut = data.draw(st.integers(0, len(text)))
    junk = data.draw(st.sampled_from(["", ":", "\t", "[", "- x", "memory: 5", "{{", "off"]))
    path = tmp_path_factory.mktemp("cfg") / "gateway.yaml"
    path.write_text(text[:cut] + junk)
    try:
        load_rules(path, {})
    except RulesError as exc:
        assert exc.reason


@pytest.mark.parametrize("status", [500, 503])
async def test_upstream_errors_relayed_unchanged(
    gateway: GatewayFactory, upstream: Upstream, status: int
) -> None:
    """5xx from the upstream reaches the client as is (status and body)."""
    gw = await gateway(upstream_url=f"{upstream.url}/status/{status}")
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=orjson.dumps(sample("chat_short"))) as r:
        assert r.status == status
        assert (await r.json())["error"]["message"] == f"upstream says {status}"


async def test_reset_mid_stream_is_cut_for_the_client_and_logged(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """An upstream that dies mid-stream: the client's stream is cut after what arrived
    (its SDK raises, as it would talking to the upstream), [mem] says so."""

    async def dying(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"partial": true}\n\n')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", dying)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=orjson.dumps(sample("chat_short"))) as r:
        assert r.status == 200
        body = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async for chunk in r.content.iter_any():
                body += chunk
    assert body == b'data: {"partial": true}\n\n'
    ev = (await gw.wait_mem(1))[-1]
    assert ev["stream"] == "upstream_aborted"


async def test_malformed_sse_is_relayed_as_is(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """The gateway relays bytes; it does not parse (or break on) a malformed event stream."""
    junk = b"data: {not json\n\nevent without data\n\ndata: [DONE]\n\n"

    async def bad(request: web.Request) -> web.Response:
        return web.Response(body=junk, content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", bad)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=orjson.dumps(sample("chat_short"))) as r:
        assert await r.read() == junk


@pytest.mark.parametrize(("raw", "evict"), [
    (b"", "skipped"), (b"\xff\xfe\x00garbage", "skipped"), (b'{"messages": [' * 2000, "skipped"),
    (b'{"a": 1, "a": 2, "messages": []}', "none"), (b"null", "skipped")])
async def test_bad_bodies_never_500(gateway: GatewayFactory, upstream: Upstream,
                                    raw: bytes, evict: str) -> None:
    """Empty, invalid UTF-8, deeply nested, duplicate keys, null: forwarded, no gateway 500."""
    gw = await gateway(memory={"enable_eviction": True})
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=raw,
            headers={"Content-Type": "text/plain", "Authorization": f"Bearer {SECRET}"}) as r:
        assert r.status == 200
    assert upstream.received[-1]["raw"] == raw
    assert (await gw.wait_mem(1))[-1]["evict"] == evict
