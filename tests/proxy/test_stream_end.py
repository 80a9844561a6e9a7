"""Stream completion is judged by the upstream's terminal event (chat `data: [DONE]`,
Anthropic `message_stop`, Responses `response.completed|failed|incomplete`) relayed to
the client, not by whether the client hung up after it."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gateway.proxy.upstream import StreamEnd
from gateway.wire import WIRES as API
from tests.conftest import (
    GatewayFactory,
    anthropic_events,
    responses_events,
    sample,
    sse,
    sse_chunks,
)

HOLD_S = 0.3  # the upstream keeps the connection open this long after its last event


def failed_events() -> list[bytes]:
    return [sse("response.created", {"type": "response.created", "sequence_number": 0}),
            sse("response.failed", {"type": "response.failed", "sequence_number": 1,
                                    "response": {"status": "failed"}})]


# path, the events of one complete stream, the client's request body
WIRES: dict[str, tuple[str, list[bytes], dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", sse_chunks(["Hel", "lo"]),
             {**sample("chat_short"), "stream": True}),
    "anthropic": ("/v1/messages", anthropic_events("Hello there"),
                  {"model": "claude-3-5-haiku-20241022", "max_tokens": 50, "stream": True,
                   "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", responses_events("Hello there"),
                  {"model": "gpt-4o-mini", "input": "hi", "stream": True}),
    "responses_failed": ("/v1/responses", failed_events(),
                         {"model": "gpt-4o-mini", "input": "hi", "stream": True}),
}
TERMINAL = (b"data: [DONE]", b"event: message_stop", b"event: response.completed",
            b"event: response.failed")


async def start_upstream(aiohttp_server: Any, events: list[bytes], mode: str) -> str:
    """An SSE upstream. complete: every event, then HOLD_S before the stream's end;
    pause: the first half, HOLD_S, the rest; abort: the first half, then a reset."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        half = len(events) // 2
        for e in events[:half] if mode != "complete" else events:
            await resp.write(e)
        await asyncio.sleep(HOLD_S)
        if mode == "abort":
            assert request.transport is not None
            request.transport.abort()
            return resp
        if mode == "pause":
            for e in events[half:]:
                await resp.write(e)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/{tail:.*}", stream)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def read_until_end(url: str, body: dict[str, Any]) -> bytes:
    """A client that stops reading and closes its connection as soon as it holds the
    terminal event (what the openai SDK does after [DONE])."""
    got = b""
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, data=orjson.dumps(body),
                         headers={"Content-Type": "application/json"})
        async for chunk in r.content.iter_any():
            got += chunk
            if any(t in got for t in TERMINAL) and got.endswith(b"\n\n"):
                break
        r.close()
    return got


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_client_closing_after_terminal_event_is_complete(
    gateway: GatewayFactory, aiohttp_server: Any, wire: str
) -> None:
    """A client that closes right after the terminal event, while the upstream has not
    ended the stream yet: logged complete (no stream= field), status 200."""
    path, events, body = WIRES[wire]
    up = await start_upstream(aiohttp_server, events, "complete")
    gw = await gateway(upstream_url=up, env={"MEMGATE_ANTHROPIC_UPSTREAM": up})
    got = await read_until_end(gw.url + path, body)
    assert got == b"".join(events)
    ev = (await gw.wait_mem(1, timeout_s=HOLD_S + 10))[-1]
    assert ev["status"] == "200" and "stream" not in ev, ev


async def test_openai_sdk_stream_closed_after_done_is_complete(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """The openai SDK closes its connection right after [DONE]: the stream it read whole
    is logged complete."""
    up = await start_upstream(aiohttp_server, sse_chunks(["Hel", "lo"]), "complete")
    gw = await gateway(upstream_url=up)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-x",
                                  max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "Hello"
    ev = (await gw.wait_mem(1, timeout_s=HOLD_S + 10))[-1]
    assert ev["status"] == "200" and "stream" not in ev, ev


@pytest.mark.parametrize("wire", ["chat", "anthropic", "responses"])
async def test_client_leaving_mid_stream_is_client_gone(
    gateway: GatewayFactory, aiohttp_server: Any, wire: str
) -> None:
    """A client that leaves before the terminal event: still client_gone."""
    path, events, body = WIRES[wire]
    up = await start_upstream(aiohttp_server, events, "pause")
    gw = await gateway(upstream_url=up, env={"MEMGATE_ANTHROPIC_UPSTREAM": up})
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + path, data=orjson.dumps(body),
                         headers={"Content-Type": "application/json"})
        await r.content.readany()
        r.close()
    ev = (await gw.wait_mem(1, timeout_s=HOLD_S + 10))[-1]
    assert ev["stream"] == "client_gone", ev


@pytest.mark.parametrize("wire", ["chat", "anthropic", "responses"])
async def test_upstream_abort_mid_stream_is_upstream_aborted(
    gateway: GatewayFactory, aiohttp_server: Any, wire: str
) -> None:
    """An upstream that dies before its terminal event: upstream_aborted, and the client
    sees its stream cut, as it would talking to the upstream (its SDK raises, and may
    retry), never a clean end after half an answer."""
    path, events, body = WIRES[wire]
    up = await start_upstream(aiohttp_server, events, "abort")
    gw = await gateway(upstream_url=up, env={"MEMGATE_ANTHROPIC_UPSTREAM": up})
    for url in (up + path, gw.url + path):  # direct, then through the gateway: the same
        got = b""
        async with aiohttp.ClientSession() as s, s.post(
                url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in r.content.iter_any():
                    got += chunk
        assert got == b"".join(events[: len(events) // 2]), url
    ev = (await gw.wait_mem(1, timeout_s=HOLD_S + 10))[-1]
    assert ev["stream"] == "upstream_aborted", ev


async def test_terminal_text_inside_a_delta_is_not_the_end(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """A delta whose text reads like a terminal event (newlines are escaped inside a JSON
    data line) does not make a stream the client left early complete."""
    fake = {"choices": [{"index": 0, "delta": {"content": "\ndata: [DONE]\n\n"}}]}
    done, x = sse_chunks(["x"])[-1], sse_chunks(["x"])[0]
    events = [x, b"data: " + orjson.dumps(fake) + b"\n\n", x, done]
    up = await start_upstream(aiohttp_server, events, "pause")
    gw = await gateway(upstream_url=up)
    got = b""
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.url + "/v1/chat/completions",
                         data=orjson.dumps({**sample("chat_short"), "stream": True}))
        while b"[DONE]" not in got:  # the fake is the last line relayed so far
            got += await r.content.readany()
        r.close()
    assert got == b"".join(events[:2])
    ev = (await gw.wait_mem(1, timeout_s=HOLD_S + 10))[-1]
    assert ev["stream"] == "client_gone", ev


@given(wire=st.sampled_from(sorted(WIRES)), coding=st.sampled_from(["", "gzip", "deflate"]),
       data=st.data())
def test_stream_end_seen_at_any_chunking(wire: str, coding: str, data: st.DataObject) -> None:
    """However the upstream's bytes are cut into chunks, and whether they come
    compressed or not, the terminal event is seen in the chunk that completes its line
    (of a compressed stream: the chunk whose bytes inflate to it), never before."""
    events = WIRES[wire][1]
    stream = b"".join(events)
    if coding:  # each event flushed, as a compressing server streams
        z = zlib.compressobj(wbits=31 if coding == "gzip" else 15)
        stream = b"".join(z.compress(e) + z.flush(zlib.Z_SYNC_FLUSH) for e in events)
        stream += z.flush()
    cuts = sorted(data.draw(st.sets(st.integers(1, len(stream) - 1), max_size=40)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    ends = API["messages" if wire == "anthropic" else
               "chat" if wire == "chat" else "responses"].stream_ends
    end, ended = StreamEnd(ends, coding or None), False
    plain = zlib.decompressobj(wbits=47) if coding else None  # 47: gzip or zlib header
    so_far = b"\n"
    for chunk in chunks:  # the relay stops looking once it has seen the end
        so_far += plain.decompress(chunk) if plain else chunk
        ended = ended or end.seen(chunk)
        assert ended == any(b"\n" + e in so_far for e in ends)
    assert ended


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_compressed_stream_lingering_after_its_end_is_complete(
    gateway: GatewayFactory, aiohttp_server: Any, coding: str
) -> None:
    """An upstream that compresses its event stream and keeps the connection open past
    read_timeout_s after message_stop: the terminal event is found in the inflated
    bytes, so the client's stream ends cleanly (the Anthropic SDK reads it whole) and
    the line says complete, as for an uncompressed stream."""
    events = anthropic_events("Hello there")

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Content-Encoding": coding})
        await resp.prepare(request)
        z = zlib.compressobj(wbits=31 if coding == "gzip" else 15)
        for e in events:  # each event flushed as its own compressed chunk
            await resp.write(z.compress(e) + z.flush(zlib.Z_SYNC_FLUSH))
        await asyncio.sleep(3 * HOLD_S)  # longer than the gateway's read timeout
        await resp.write(z.flush())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", stream)
    url = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    gw = await gateway(upstreams=[{"name": "slow", "base_url": url, "read_timeout_s": HOLD_S,
                                   "paths": ["/v1/messages"]}], upstream_url=url)
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-ant-x",
                                        max_retries=0) as client:
        async with client.messages.stream(
                model="claude-3-5-haiku-20241022", max_tokens=50,
                messages=[{"role": "user", "content": "hi"}]) as s:
            text = "".join([t async for t in s.text_stream])
    assert text == "Hello there "
    ev = (await gw.wait_mem(1, timeout_s=HOLD_S + 10))[-1]
    assert ev["status"] == "200" and "stream" not in ev, ev
