"""The gateway through real HTTP: openai SDK -> gateway -> aiohttp test upstream."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web

from tests.conftest import CHAT_REPLY, SECRET, Gateway, GatewayFactory, Upstream, sample


def client(gw: Gateway, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0, **kw)


async def post_raw(gw: Gateway, body: bytes, path: str = "/v1/chat/completions",
                   headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"}
    hdrs.update(headers or {})
    async with aiohttp.ClientSession() as s, s.post(gw.url + path, data=body, headers=hdrs) as r:
        return r.status, await r.read(), r.headers


async def test_openai_sdk_non_stream(gateway: GatewayFactory, upstream: Upstream) -> None:
    """The openai SDK gets a parsed completion through the gateway unchanged."""
    gw = await gateway()
    async with client(gw) as c:
        resp = await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
        )
    assert resp.choices[0].message.content == "hello from upstream"
    assert upstream.received[-1]["path"] == "/v1/chat/completions"
    assert upstream.received[-1]["headers"]["Authorization"] == f"Bearer {SECRET}"


async def test_openai_sdk_stream_arrives_chunk_by_chunk(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """SSE deltas reach the SDK as separate chunks, in order, with the stream's end."""
    gw = await gateway()
    arrivals: list[tuple[float, str]] = []
    async with client(gw) as c:
        stream = await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append((time.perf_counter(), chunk.choices[0].delta.content))
    assert [w for _, w in arrivals] == ["Hel", "lo", " wor", "ld"]
    # the upstream sleeps 10 ms between chunks: a buffering relay would deliver them together
    assert arrivals[-1][0] - arrivals[0][0] >= 0.02


async def test_body_byte_identical_when_eviction_off(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """With enable_eviction false the upstream receives the client's exact bytes."""
    gw = await gateway(memory={"enable_eviction": False, "shadow": True})
    raw = json.dumps(sample("chat_long_tools"), indent=3, ensure_ascii=True).encode()
    status, _, _ = await post_raw(gw, raw)
    assert status == 200
    assert upstream.received[-1]["raw"] == raw
    ev = gw.mem_events()[-1]
    assert ev["mode"] == "shadow" and ev["dropped"] == "0" and int(ev["would_drop"]) > 0


async def test_eviction_on_forwards_fewer_messages_keeping_pin_and_pairs(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction on: old turns gone, the early [PIN] kept, every tool call with its results."""
    gw = await gateway(memory={"enable_eviction": True})
    body = sample("chat_long_tools")
    status, _, _ = await post_raw(gw, orjson.dumps(body))
    assert status == 200
    fwd = upstream.last_body()
    msgs = fwd["messages"]
    assert len(msgs) < len(body["messages"])
    assert msgs[0] == body["messages"][0]
    assert msgs[-1] == body["messages"][-1]
    assert any(isinstance(m.get("content"), str) and m["content"].startswith("[PIN] Constraint")
               for m in msgs)
    calls = {c["id"] for m in msgs for c in m.get("tool_calls") or []}
    results = {m["tool_call_id"] for m in msgs if m["role"] == "tool"}
    assert calls == results
    assert {k: v for k, v in fwd.items() if k != "messages"} == {
        k: v for k, v in body.items() if k != "messages"
    }
    ev = gw.mem_events()[-1]
    assert ev["mode"] == "on"
    assert int(ev["kept"]) == len(msgs)
    assert int(ev["dropped"]) == len(body["messages"]) - len(msgs)


async def test_mem_line_fields_and_order(gateway: GatewayFactory, upstream: Upstream) -> None:
    """One [mem] line per request with the seed's fields first and known values."""
    gw = await gateway()
    body = {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "héllo 你好"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": "again"},
        ],
    }
    await post_raw(gw, orjson.dumps(body), headers={"X-Session-Id": "s-abc"})
    lines = gw.mem_lines()
    assert len(lines) == 1
    keys = [part.split("=")[0] for part in lines[0][6:].split(" ")]
    assert keys[:10] == ["session", "turn", "hist_msgs", "hist_chars", "est_tokens",
                         "budget_tokens", "evict", "kept", "dropped", "pinned"]
    assert keys[10:16] == ["mode", "model", "status", "upstream_ms", "overhead_ms", "req"]
    ev = gw.mem_events()[0]
    # jq: "Be brief." 9 + "héllo 你好" 8 + null->0 + '[{"type":"text","text":"ok"}]' 29 + 5
    assert ev["hist_chars"] == str(9 + 8 + 0 + 29 + 5)
    assert ev["session"] == "s-abc" and ev["turn"] == "2" and ev["hist_msgs"] == "5"
    assert ev["status"] == "200" and ev["model"] == "gpt-4o-mini"
    assert int(ev["est_tokens"]) > 5 * 3


async def test_json_log_format(gateway: GatewayFactory, upstream: Upstream) -> None:
    """logging.format json emits the same keys as one JSON object with event=mem."""
    gw = await gateway(logging={"format": "json"}, fmt="json")
    await post_raw(gw, orjson.dumps(sample("chat_short")))
    objs = [json.loads(ln) for ln in gw.log.getvalue().splitlines() if '"event":"mem"' in ln]
    assert len(objs) == 1
    assert objs[0]["hist_msgs"] == 4 and objs[0]["hist_chars"] == 132
    assert objs[0]["mode"] == "shadow"


async def test_secrets_never_logged(gateway: GatewayFactory, upstream: Upstream) -> None:
    """Authorization and x-api-key values and message text stay out of the logs."""
    gw = await gateway(logging={"level": "debug"}, level="debug")
    body = sample("chat_long_tools")
    await post_raw(gw, orjson.dumps(body), headers={"x-api-key": SECRET + "-x"})
    async with client(gw) as c:
        await c.chat.completions.create(model="gpt-4o-mini",
                                        messages=[{"role": "user", "content": "topsecret"}])
    text = gw.log.getvalue()
    assert text.count("[mem]") == 2
    assert SECRET not in text
    assert "topsecret" not in text and "report_0421" not in text


async def test_passthrough_routes(gateway: GatewayFactory, upstream: Upstream) -> None:
    """Other routes are relayed: method, path, query, body, status and headers."""
    gw = await gateway()
    async with client(gw) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == ["gpt-4o-mini"]
    payload = b"\x00\x01binary" * 1000
    async with aiohttp.ClientSession() as s, s.put(
        f"{gw.url}/v1/echo?x=1&y=2", data=payload, headers={"Authorization": "Bearer k"}
    ) as r:
        assert r.status == 201
        assert r.headers["X-Upstream"] == "yes"
        assert await r.read() == payload
    assert upstream.received[-1]["method"] == "PUT"
    assert upstream.received[-1]["path"] == "/v1/echo?x=1&y=2"
    assert gw.mem_lines() == []


async def test_hop_by_hop_headers_stop_at_the_gateway(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """Headers a message's Connection names are its hop's (RFC 9110 7.6.1), in either
    direction; Proxy-Connection too; and the client's Expect: 100-continue is answered
    here (passed on, the gateway's request would wait for the upstream's own 100)."""
    seen: list[Any] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.copy())
        await request.read()
        return web.json_response(CHAT_REPLY, headers={"Connection": "keep-alive, X-Hop",
                                                      "X-Hop": "secret", "X-End": "end"})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/chat/completions", data=orjson.dumps(sample("chat_short")),
            headers={"Connection": "keep-alive, X-Foo", "X-Foo": "hop", "X-Bar": "end",
                     "Proxy-Connection": "keep-alive", "Expect": "100-continue",
                     "Content-Type": "application/json"}) as r:
        assert r.status == 200
        assert "X-Hop" not in r.headers and r.headers["X-End"] == "end"
    (got,) = seen
    assert got["X-Bar"] == "end"
    assert not {"X-Foo", "Proxy-Connection", "Expect"} & set(got)


async def test_big_and_many_answer_headers_are_relayed(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """An answer with a 9,000-byte header and 200 headers (over aiohttp's client defaults:
    8 KiB, 128) reaches the client as the upstream sent it, not as a 502."""
    many = {f"X-H{i}": str(i) for i in range(200)}

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(CHAT_REPLY, headers={"X-Big": "b" * 9000, **many})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession(max_field_size=16 << 10, max_headers=512) as s, s.post(
            gw.url + "/v1/chat/completions", data=orjson.dumps(sample("chat_short"))) as r:
        assert r.status == 200 and await r.json() == CHAT_REPLY
        assert r.headers["X-Big"] == "b" * 9000 and r.headers["X-H199"] == "199"


async def test_answer_header_bytes_not_utf8_are_kept_as_latin1(
    gateway: GatewayFactory,
) -> None:
    """An upstream whose header value and reason phrase hold bytes that are not UTF-8
    (Latin-1 obs-text): every character reaches the client (written as UTF-8), none is
    dropped, and valid headers beside them are untouched."""
    answer = (b"HTTP/1.1 200 Caf\xe9 OK\r\nContent-Type: application/json\r\n"
              b"Content-Disposition: attachment; filename=\"r\xe9sum\xe9.txt\"\r\n"
              b"X-Plain: caf\xc3\xa9\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await gateway(upstream_url=f"http://127.0.0.1:{port}")
        reader, writer = await asyncio.open_connection(gw.server.host, gw.server.port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        got = await reader.read()
        writer.close()
    finally:
        server.close()
    head = got.split(b"\r\n\r\n", 1)[0].decode("utf-8").split("\r\n")
    assert head[0] == "HTTP/1.1 200 Caf\u00e9 OK"
    assert 'Content-Disposition: attachment; filename="r\u00e9sum\u00e9.txt"' in head
    assert "X-Plain: caf\u00e9" in head  # UTF-8 from the upstream: relayed as it came
    assert got.endswith(b"\r\n\r\n{}")


async def test_anthropic_sdk_calls_off_messages_go_to_anthropic(
    gateway: GatewayFactory, upstream: Upstream, aiohttp_server: Any
) -> None:
    """With the shipped upstreams (anthropic for /v1/messages*, openai for the rest), the
    anthropic SDK's other calls (models, files) go to Anthropic, never with its key to
    the OpenAI upstream; the OpenAI SDK's go to OpenAI."""
    import anthropic

    hits: list[str] = []

    async def models(request: web.Request) -> web.Response:
        hits.append(request.headers.get("x-api-key") or request.headers.get("Authorization", ""))
        return web.json_response({"data": [{"type": "model", "id": "claude-x",
                                            "display_name": "X", "created_at":
                                            "2025-01-01T00:00:00Z"}],
                                  "has_more": False, "first_id": "claude-x",
                                  "last_id": "claude-x"})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    ant = await aiohttp_server(app)
    gw = await gateway(upstreams=[
        {"name": "anthropic", "base_url": str(ant.make_url("")).rstrip("/"),
         "paths": ["/v1/messages*"]},
        {"name": "openai", "base_url": upstream.url, "paths": ["/*"]}],
        upstream_url=upstream.url)
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-ant-k",
                                        max_retries=0) as c:
        page = await c.models.list()
    assert [m.id for m in page.data] == ["claude-x"] and hits[0].endswith("sk-ant-k")
    assert not [r for r in upstream.received if r["path"].startswith("/v1/models")]
    async with client(gw) as oc:
        assert [m.id for m in (await oc.models.list()).data] == ["gpt-4o-mini"]


async def test_websocket_is_relayed_message_by_message(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """A WebSocket (what OpenAI(base_url=gateway).realtime.connect() opens) goes to the
    upstream with the client's key, query and subprotocol, and every text and binary
    message comes back as sent, then the close; a refused upgrade is the upstream's
    status."""
    seen: list[Any] = []

    async def realtime(request: web.Request) -> web.StreamResponse:
        seen.append((request.query_string, request.headers.get("Authorization")))
        if request.query.get("model") == "refused":
            return web.Response(status=403, text="no realtime for you")
        ws = web.WebSocketResponse(protocols=("realtime",))
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str("echo:" + msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data[::-1])
        return ws

    app = web.Application()
    app.router.add_get("/v1/realtime", realtime)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(f"{gw.url}/v1/realtime?model=gpt-realtime",
                                headers={"Authorization": f"Bearer {SECRET}"},
                                protocols=("realtime",)) as ws:
            assert ws.protocol == "realtime"
            await ws.send_str('{"type": "session.update"}')
            assert await ws.receive_str() == 'echo:{"type": "session.update"}'
            await ws.send_bytes(b"\x00\x01audio")
            assert await ws.receive_bytes() == b"oidua\x01\x00"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await s.ws_connect(f"{gw.url}/v1/realtime?model=refused")
    assert refused.value.status == 403
    assert seen == [("model=gpt-realtime", f"Bearer {SECRET}"), ("model=refused", None)]


async def test_targets_that_are_no_path_get_a_json_error(gateway: GatewayFactory) -> None:
    """`CONNECT host:443` (a client taking the gateway for a forward proxy) and
    `OPTIONS *`: a JSON error in the API's shape, not aiohttp's text."""
    gw = await gateway()
    for line in (b"CONNECT api.openai.com:443 HTTP/1.1", b"OPTIONS * HTTP/1.1"):
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
        writer.write(line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await reader.read()
        writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404") and b"application/json" in head, head
        err = orjson.loads(body)["error"]
        assert err["code"] == "not_routed" and "forward proxy" in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/echo", "/v1/messages"])
async def test_a_header_not_utf8_is_refused_not_changed(
    gateway: GatewayFactory, upstream: Upstream, path: str
) -> None:
    """A header value with bytes that are not UTF-8 cannot be passed on as it came (the
    HTTP client would drop them: `Bearer sk-\\xe9t` sent as `Bearer sk-t`): a 400 in the
    API's shape naming the header, and nothing reaches the upstream."""
    gw = await gateway()
    body = orjson.dumps(sample("anthropic_long_tools" if "messages" in path else "chat_short"))
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.server.port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nX-Lat: caf\xe9\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                 b"Connection: close\r\n\r\n" + body)
    data = await reader.read()
    writer.close()
    head, _, answer = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    err = orjson.loads(answer)
    if "messages" in path:
        assert err["type"] == "error"
    assert "'X-Lat'" in err["error"]["message"] and "UTF-8" in err["error"]["message"]
    assert upstream.received == []


async def test_upstream_error_relayed_unchanged(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A 429 from upstream reaches the SDK as its own RateLimitError with the body."""
    gw = await gateway(upstream_url=f"{upstream.url}/status/429")
    async with client(gw) as c:
        with pytest.raises(openai.RateLimitError) as exc:
            await c.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert "upstream says 429" in str(exc.value)
    assert gw.mem_events()[-1]["status"] == "429"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_upstream_unreachable_is_502(gateway: GatewayFactory) -> None:
    """A refused connection gives a 502 in OpenAI's error shape."""
    gw = await gateway(upstream_url=f"http://127.0.0.1:{_free_port()}")
    status, body, _ = await post_raw(gw, orjson.dumps(sample("chat_short")))
    assert status == 502
    err = orjson.loads(body)["error"]
    assert err["type"] == "gateway_error" and err["code"] == "upstream_unreachable"
    assert gw.mem_events()[-1]["status"] == "502"


async def test_anthropic_sdk_off_its_messages_routes_gets_its_error_shape(
    gateway: GatewayFactory,
) -> None:
    """The Anthropic SDK's calls beside Messages (models.list) are relayed by the
    catch-all; with the upstream down the error it reads is in Anthropic's shape (it
    sends anthropic-version on every call), the OpenAI SDK's in OpenAI's."""
    dead = f"http://127.0.0.1:{_free_port()}"
    gw = await gateway(upstream_url=dead)
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET,
                                        max_retries=0) as c:
        with pytest.raises(anthropic.APIStatusError) as exc:
            await c.models.list()
    assert exc.value.status_code == 502
    assert exc.value.body == {"type": "error", "error": {
        "type": "api_error", "message": exc.value.body["error"]["message"]}}
    assert "upstream" in exc.value.body["error"]["message"]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as o:
        with pytest.raises(openai.APIStatusError) as oexc:
            await o.models.list()
    assert oexc.value.status_code == 502
    assert oexc.value.body["code"] == "upstream_unreachable"  # type: ignore[index]


async def test_upstream_timeout_is_504(gateway: GatewayFactory, aiohttp_server: Any) -> None:
    """An upstream that accepts and never answers gives 504 after read_timeout_s."""

    async def stall(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stall)
    slow = await aiohttp_server(app)
    url = str(slow.make_url("")).rstrip("/")
    gw = await gateway(upstreams=[{"name": "slow", "base_url": url, "read_timeout_s": 0.3}],
                       upstream_url=url)
    status, body, _ = await post_raw(gw, orjson.dumps(sample("chat_short")))
    assert status == 504
    assert orjson.loads(body)["error"]["code"] == "upstream_timeout"


async def test_body_over_limit_is_413(gateway: GatewayFactory, upstream: Upstream) -> None:
    """A body over limits.max_body_bytes is refused with 413 and never forwarded."""
    gw = await gateway(limits={"max_body_bytes": 4096})
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]})
    status, body, _ = await post_raw(gw, big)
    assert status == 413
    assert "4096" in orjson.loads(body)["error"]["message"]
    assert upstream.received == []


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"this is not json", "invalid_json"),
        (b'{"model": "m", "prompt": "legacy"}', "no_messages"),
        (b"[1, 2, 3]", "not_an_object"),
        (b'{"messages": [{"role": "tool", "tool_call_id": "zz", "content": "x"}]}',
         "unpaired_tool_result"),
        (b'{"messages": ["just a string"]}', "message_not_object"),
    ],
)
async def test_bodies_not_understood_are_forwarded_unchanged(
    gateway: GatewayFactory, upstream: Upstream, raw: bytes, reason: str
) -> None:
    """Anything the gateway cannot plan goes upstream byte for byte, logged as skipped."""
    gw = await gateway(memory={"enable_eviction": True})
    upstream_url = upstream.url
    assert upstream_url
    await post_raw(gw, raw, path="/v1/chat/completions")
    assert upstream.received[-1]["raw"] == raw
    ev = gw.mem_events()[-1]
    assert ev["evict"] == "skipped" and ev["reason"] == reason


async def test_bad_gateway_metadata_is_a_clear_400(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction on with markers.on_bad_metadata: reject: malformed memgate metadata gets a
    400 naming the field; nothing is forwarded (off/shadow forward: test_metadata_lenient)."""
    gw = await gateway(memory={"enable_eviction": True,
                               "markers": {"on_bad_metadata": "reject"}})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi",
                                        "memgate": {"score": "high"}}]}
    status, raw, _ = await post_raw(gw, orjson.dumps(body))
    assert status == 400
    assert "messages[0].memgate.score" in orjson.loads(raw)["error"]["message"]
    assert upstream.received == []


async def test_gateway_metadata_stripped_in_every_mode(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Upstreams never see the memgate key, even with eviction off."""
    gw = await gateway()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi",
                                        "memgate": {"pin": True}}]}
    await post_raw(gw, orjson.dumps(body))
    assert upstream.last_body()["messages"] == [{"role": "user", "content": "hi"}]
    # a key spelled with JSON escapes is the same key: not forwarded either
    escaped = orjson.dumps(body).replace(b'"memgate"', b'"\\u006demgate"')
    assert b"memgate" not in escaped
    await post_raw(gw, escaped)
    assert upstream.last_body()["messages"] == [{"role": "user", "content": "hi"}]
    # with nothing to change, eviction off forwards the client's bytes first and measures
    # after: the [mem] line still has the full measurement
    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi 订单"}]})
    await post_raw(gw, plain)
    assert upstream.received[-1]["raw"] == plain
    ev = gw.mem_events()[-1]
    assert ev["hist_msgs"] == "1" and int(ev["est_tokens"]) > 0 and ev["mode"] == "shadow"


async def test_metadata_in_a_resent_history_s_new_message_is_stripped(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction off: a resent history is not searched for the memgate key again, only what
    follows it; metadata (plain or escaped) in a session's new message is still stripped,
    and a body without any goes upstream byte for byte."""
    gw = await gateway()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "订单 " * 6000},
                                  {"role": "assistant", "content": "ok"}]
    hdrs = {"X-Session-Id": "resent"}
    for n, extra in enumerate([None, None, {"pin": True}, None, {"score": 0.9}]):
        new: dict[str, Any] = {"role": "user", "content": f"next {n}"}
        if extra is not None:
            new["memgate"] = extra
        raw = orjson.dumps({"model": "m", "messages": [*msgs, new]})
        if n == 4:  # the key spelled with an escape
            raw = raw.replace(b'"memgate"', b'"\\u006demgate"')
        await post_raw(gw, raw, headers=hdrs)
        await gw.wait_mem(n + 1)
        got = upstream.received[-1]["raw"]
        if extra is None:
            assert got == raw
        else:
            assert b"memgate" not in got and b"u006d" not in got
            assert orjson.loads(got)["messages"][-1] == {"role": "user", "content": f"next {n}"}
        msgs += [{"role": "user", "content": f"next {n}"}, {"role": "assistant", "content": "ok"}]
    assert gw.state.history.spliced >= 3  # the resent histories were read from the records


async def test_hot_reload_by_editing_the_file(gateway: GatewayFactory, upstream: Upstream) -> None:
    """Editing enable_eviction in the YAML changes mode= of the next requests, no restart."""
    gw = await gateway()
    body = orjson.dumps(sample("chat_long_tools"))
    await post_raw(gw, body)
    assert gw.mem_events()[-1]["mode"] == "shadow"
    text = gw.config.read_text().replace("enable_eviction: false", "enable_eviction: true")
    gw.config.write_text(text)
    deadline = time.monotonic() + 2.0
    while gw.state.rules.memory.mode != "on" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await post_raw(gw, body)
    assert gw.mem_events()[-1]["mode"] == "on"
    assert len(upstream.last_body()["messages"]) < len(sample("chat_long_tools")["messages"])
    assert "config_reload result=ok trigger=watch" in gw.log.getvalue()
    # and back: the kill switch restores full history
    gw.config.write_text(text.replace("enable_eviction: true", "enable_eviction: false"))
    deadline = time.monotonic() + 2.0
    while gw.state.rules.memory.mode != "shadow" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await post_raw(gw, body)
    assert upstream.received[-1]["raw"] == body


async def test_invalid_config_keeps_last_good(gateway: GatewayFactory, upstream: Upstream) -> None:
    """A broken edit is refused with file:line key reason; the old config keeps serving."""
    gw = await gateway(memory={"enable_eviction": True})
    good = gw.state.rules
    gw.config.write_text(gw.config.read_text().replace("max_turns: 20", "max_turns: twenty"))
    deadline = time.monotonic() + 2.0
    while "config_reload result=failed" not in gw.log.getvalue() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log = gw.log.getvalue()
    assert "config_reload result=failed" in log
    assert "key=memory.budget.max_turns" in log and "line=" in log
    assert gw.state.rules is good
    await post_raw(gw, orjson.dumps(sample("chat_long_tools")))
    assert gw.mem_events()[-1]["mode"] == "on"


async def test_sighup_reloads(gateway: GatewayFactory, upstream: Upstream) -> None:
    """SIGHUP reloads the file at once (the watcher is slowed down here to prove it)."""
    import os
    import signal

    gw = await gateway(watch_interval_s=3600)
    gw.config.write_text(gw.config.read_text().replace("enable_eviction: false",
                                                       "enable_eviction: true"))
    os.kill(os.getpid(), signal.SIGHUP)
    deadline = time.monotonic() + 2.0
    while gw.state.rules.memory.mode != "on" and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert gw.state.rules.memory.mode == "on"
    assert "trigger=sighup" in gw.log.getvalue()


async def test_env_overrides_file(gateway: GatewayFactory, upstream: Upstream) -> None:
    """MEMGATE_ENABLE_EVICTION=1 wins over enable_eviction: false in the file."""
    gw = await gateway(env={"MEMGATE_ENABLE_EVICTION": "1"})
    await post_raw(gw, orjson.dumps(sample("chat_long_tools")))
    assert gw.mem_events()[-1]["mode"] == "on"


async def test_client_disconnect_cancels_upstream(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """A client that goes away mid-stream cancels the upstream request."""
    cancelled = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: {}\n\n")
                await asyncio.sleep(0.02)
        except (asyncio.CancelledError, ConnectionResetError):
            cancelled.set()
            raise

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(sample("chat_short")),
                         headers={"Content-Type": "application/json"})
        await r.content.readany()
        r.close()
    await asyncio.wait_for(cancelled.wait(), 3)
    deadline = time.monotonic() + 2
    while not gw.mem_lines() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert gw.mem_events()[-1]["stream"] == "client_gone"


async def test_health_and_ready(gateway: GatewayFactory) -> None:
    """/healthz answers ok; /readyz names the config and the mode."""
    gw = await gateway()
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(f"{gw.url}/readyz") as r:
            data = await r.json()
            assert r.status == 200 and data["mode"] == "shadow"
            assert data["config"].endswith("gateway.yaml")
