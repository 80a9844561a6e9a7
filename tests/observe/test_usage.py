"""The provider's own usage, read from every answer as it is relayed: the [mem] fields,
the metric and `memgate stats`, for all three wires, JSON and SSE, through real HTTP
with the real SDKs as callers."""

from __future__ import annotations

import asyncio
import gzip
import io
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.cli import stats
from gateway.cli.mock_upstream import create_mock_app
from gateway.config.rules import load_rules
from gateway.observe.usage import (
    BODY_BYTES,
    INFLATE_PIECE,
    LINE_BYTES,
    Inflate,
    UsageReader,
    reader_for,
)
from tests.conftest import SECRET, GatewayFactory, Upstream

ROOT = Path(__file__).resolve().parents[2]
CLAUDE = "claude-3-5-haiku-20241022"


@pytest.fixture
async def mock(aiohttp_server: Any) -> str:
    """The built-in mock upstream (the one `memgate demo` uses), its base URL."""
    server = await aiohttp_server(create_mock_app())
    return str(server.make_url("")).rstrip("/")


def chat_history(turns: int = 12) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 200}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t} about the build " + "w " * 300},
                 {"role": "assistant", "content": f"answer {t}"}]
    msgs.append({"role": "user", "content": "And now?"})
    return msgs


def usage_of(ev: dict[str, str]) -> dict[str, int]:
    return {k: int(v) for k, v in ev.items() if k.startswith("usage_")}


async def scrape(gw: Any) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as r:
        return await r.text()


def metric(text: str, route: str, model: str, kind: str) -> float:
    name = (f'memgate_usage_tokens_total{{kind="{kind}",model="{model}",route="{route}"}}')
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


async def test_openai_chat_json_and_stream(gateway: GatewayFactory, mock: str) -> None:
    """openai SDK, chat: the [mem] line carries the usage the client got, JSON and with
    stream_options.include_usage; the metric counts it under the models-file glob; the
    same prefix sent again is partly read from the provider's cache."""
    gw = await gateway(upstream_url=mock)
    msgs = chat_history()
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        first = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                                extra_headers={"X-Session-Id": "s1"})
        stream = await c.chat.completions.create(
            model="gpt-4o-mini", messages=msgs, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "s1"})
        finals = [ch.usage async for ch in stream if ch.usage is not None]
    assert first.usage is not None and len(finals) == 1
    second = finals[0]
    assert second.prompt_tokens_details is not None
    assert second.prompt_tokens_details.cached_tokens > 0  # the mock's prompt cache hit
    ev = await gw.wait_mem(2)
    for e, u in zip(ev, (first.usage, second), strict=True):
        assert u.prompt_tokens_details is not None
        assert usage_of(e) == {"usage_in": u.prompt_tokens,
                               "usage_cached": u.prompt_tokens_details.cached_tokens,
                               "usage_out": u.completion_tokens}
    text = await scrape(gw)
    total_in = first.usage.prompt_tokens + second.prompt_tokens
    assert metric(text, "openai_chat", "gpt-4o*", "input") == total_in
    assert metric(text, "openai_chat", "gpt-4o*", "output") == (
        first.usage.completion_tokens + second.completion_tokens)
    assert "gpt-4o-mini" not in text.split("memgate_usage_tokens_total", 1)[1].split("# HELP")[0]


async def test_chat_stream_without_include_usage_has_no_fields(
    gateway: GatewayFactory, mock: str
) -> None:
    """A stream the client did not ask usage for carries none: no usage_* fields, no count."""
    gw = await gateway(upstream_url=mock)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        stream = await c.chat.completions.create(model="gpt-4o-mini", messages=chat_history(2),  # type: ignore[arg-type]
                                                 stream=True)
        assert [ch.usage async for ch in stream if ch.usage is not None] == []
    ev = (await gw.wait_mem(1))[-1]
    assert ev["status"] == "200" and usage_of(ev) == {}
    assert "memgate_usage_tokens_total{" not in await scrape(gw)


async def test_responses_json_and_stream(gateway: GatewayFactory, mock: str) -> None:
    """openai SDK, Responses: input/cached/output from the JSON answer and from the
    response.completed event of a stream."""
    gw = await gateway(upstream_url=mock)
    items = [m for m in chat_history() if m["role"] != "system"]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        plain = await c.responses.create(model="gpt-4.1-mini", input=items,  # type: ignore[arg-type]
                                         instructions="Be brief.")
        done = None
        async with c.responses.stream(model="gpt-4.1-mini", input=items,  # type: ignore[arg-type]
                                      instructions="Be brief.") as s:
            async for event in s:
                if event.type == "response.completed":
                    done = event.response
    assert plain.usage is not None and done is not None and done.usage is not None
    ev = await gw.wait_mem(2)
    for e, u in zip(ev, (plain.usage, done.usage), strict=True):
        assert e["api"] == "openai_responses"
        assert usage_of(e) == {"usage_in": u.input_tokens,
                               "usage_cached": u.input_tokens_details.cached_tokens,
                               "usage_out": u.output_tokens}
    assert done.usage.input_tokens_details.cached_tokens > 0
    text = await scrape(gw)
    assert metric(text, "openai_responses", "gpt-4.1*", "cached") == (
        done.usage.input_tokens_details.cached_tokens
        + plain.usage.input_tokens_details.cached_tokens)


async def test_anthropic_json_and_stream_usage_in_is_the_whole_prompt(
    gateway: GatewayFactory, mock: str
) -> None:
    """anthropic SDK: usage_in = input_tokens + cache reads + cache writes (every prompt
    token, as OpenAI's prompt_tokens), usage_cached = cache reads, usage_cache_write =
    cache creation; in a stream from message_start and the last message_delta."""
    gw = await gateway(upstream_url=mock)
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "context " * 3000,
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "Read."},
        {"role": "user", "content": "Summarise."}]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as c:
        first = await c.messages.create(model=CLAUDE, max_tokens=100, messages=msgs,  # type: ignore[arg-type]
                                        extra_headers={"X-Session-Id": "a1"})
        async with c.messages.stream(model=CLAUDE, max_tokens=100, messages=msgs,  # type: ignore[arg-type]
                                     extra_headers={"X-Session-Id": "a1"}) as s:
            second = (await s.get_final_message()).usage
    assert (first.usage.cache_creation_input_tokens or 0) > 0  # written, then
    assert (second.cache_read_input_tokens or 0) > 0  # read from the cache
    ev = await gw.wait_mem(2)
    for e, u in zip(ev, (first.usage, second), strict=True):
        read, write = u.cache_read_input_tokens or 0, u.cache_creation_input_tokens or 0
        assert usage_of(e) == {"usage_in": u.input_tokens + read + write,
                               "usage_cached": read, "usage_out": u.output_tokens,
                               "usage_cache_write": write}
    text = await scrape(gw)
    assert metric(text, "anthropic_messages", "claude-*", "cache_write") == (
        (first.usage.cache_creation_input_tokens or 0) + (second.cache_creation_input_tokens or 0))


async def test_azure_deployment_and_unknown_model_label(
    gateway: GatewayFactory, upstream: Upstream, mock: str
) -> None:
    """AzureOpenAI client on a deployment route: same shapes, same fields; a model the
    models file does not name is counted as model="other", never its own string."""
    gw = await gateway(upstreams=[{"name": "azure", "base_url": mock, "paths": ["/openai/*"]},
                                  {"name": "openai", "base_url": upstream.url,
                                   "paths": ["/*"]}])
    client = openai.AsyncAzureOpenAI(azure_endpoint=gw.url, api_key="x",
                                     api_version="2024-10-21", max_retries=0)
    async with client:
        resp = await client.chat.completions.create(model="prod-deploy-7",
                                                    messages=chat_history(2))  # type: ignore[arg-type]
    assert resp.usage is not None
    ev = (await gw.wait_mem(1))[-1]
    assert int(ev["usage_in"]) == resp.usage.prompt_tokens
    text = await scrape(gw)
    assert metric(text, "openai_chat", "other", "input") == resp.usage.prompt_tokens
    assert "prod-deploy-7" not in text


async def test_error_answer_has_no_usage(gateway: GatewayFactory, upstream: Upstream) -> None:
    """An upstream's error answer carries no usage: no fields, no count."""
    gw = await gateway(upstream_url=f"{upstream.url}/status/429")
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(model="gpt-4o-mini",
                                            messages=[{"role": "user", "content": "hi"}])
    ev = (await gw.wait_mem(1))[-1]
    assert ev["status"] == "429" and usage_of(ev) == {}


# --------------------------------------------------------------------------- odd answers

def chat_reply(text: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "chatcmpl-x", "object": "chat.completion", "created": 1,
                            "model": "gpt-4o-mini",
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": text}}]}
    if usage is not None:
        body["usage"] = usage
    return body


USAGE = {"prompt_tokens": 1234, "completion_tokens": 56, "total_tokens": 1290,
         "prompt_tokens_details": {"cached_tokens": 1024}}


@pytest.fixture
async def odd(aiohttp_server: Any) -> str:
    """An upstream whose answers are gzip'd, huge, or streamed a byte at a time."""

    async def gzipped(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=gzip.compress(orjson.dumps(chat_reply("zipped", USAGE))),
                            headers={"Content-Encoding": "gzip"},
                            content_type="application/json")

    async def huge(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        text = "x" * (6 * 1024 * 1024)
        if body.get("user") == "usage-first":  # the usage far from the end: not looked for
            raw = orjson.dumps({"usage": USAGE, **chat_reply(text, None)})
        else:
            raw = orjson.dumps(chat_reply(text, USAGE))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(raw)
        await resp.prepare(request)
        for i in range(0, len(raw), 65536):
            await resp.write(raw[i:i + 65536])
        await resp.write_eof()
        return resp

    async def trickle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        last = {"id": "c", "object": "chat.completion.chunk", "created": 1,
                "model": "gpt-4o-mini", "choices": [], "usage": USAGE}
        first = {**last, "choices": [{"index": 0, "delta": {"content": "hi"},
                                      "finish_reason": "stop"}], "usage": None}
        stream = (b"data: " + orjson.dumps(first) + b"\n\ndata: " + orjson.dumps(last)
                  + b"\n\ndata: [DONE]\n\n")
        cut = stream.index(b'"usage":{') + 3  # inside the key of the event that counts
        for part in (stream[:cut], stream[cut:cut + 40], stream[cut + 40:]):
            await resp.write(part)
            await asyncio.sleep(0.05)  # each its own chunk at the gateway
        await resp.write_eof()
        return resp

    async def bomb(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=BOMB, headers={"Content-Encoding": "deflate"},
                            content_type="application/json")

    app = web.Application()
    app.router.add_post("/bomb/v1/chat/completions", bomb)
    app.router.add_post("/gzip/v1/chat/completions", gzipped)
    app.router.add_post("/huge/v1/chat/completions", huge)
    app.router.add_post("/trickle/v1/chat/completions", trickle)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_gzip_answer_is_read_and_relayed_compressed(
    gateway: GatewayFactory, odd: str
) -> None:
    """A gzip'd answer goes to the client as it came (the SDK inflates it) and its usage
    is read from an inflated copy."""
    gw = await gateway(upstream_url=f"{odd}/gzip")
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        resp = await c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert resp.headers["content-encoding"] == "gzip"
    assert resp.parse().choices[0].message.content == "zipped"
    ev = (await gw.wait_mem(1))[-1]
    assert usage_of(ev) == {"usage_in": 1234, "usage_cached": 1024, "usage_out": 56}


# a 40 MiB answer deflated to ~40 KB: one chunk of the upstream's inflates to 40 MiB
BOMB = zlib.compress(orjson.dumps(chat_reply("x" * (40 << 20), USAGE)), 9)


async def test_deflate_bomb_chunk_is_read_in_bounded_pieces(
    gateway: GatewayFactory, odd: str
) -> None:
    """An answer whose ~40 KB deflate chunk inflates to 40 MiB: the client gets the
    upstream's bytes unchanged, its usage (at the end) is read, and the gateway's memory
    meanwhile grows by a bounded amount, nowhere near the inflated size."""
    assert len(BOMB) < 64 * 1024
    gw = await gateway(upstream_url=f"{odd}/bomb")
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user",
                                                               "content": "hi"}]})
    tracemalloc.start()
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as s, s.post(
                f"{gw.url}/v1/chat/completions", data=body,
                headers={"Authorization": f"Bearer {SECRET}",
                         "Content-Type": "application/json"}) as r:
            raw = await r.read()
            encoding = r.headers.get("Content-Encoding")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status == 200 and encoding == "deflate" and raw == BOMB
    assert peak < 4 << 20, peak  # was ~80 MiB: the whole inflated chunk, then joined
    ev = (await gw.wait_mem(1))[-1]
    assert usage_of(ev) == {"usage_in": 1234, "usage_cached": 1024, "usage_out": 56}


def test_inflated_pieces_are_bounded_and_lose_nothing() -> None:
    """Each inflated piece is at most INFLATE_PIECE bytes, and the pieces, in order, are
    the answer (several gzip members, raw deflate and zlib deflate, any chunking)."""
    text = orjson.dumps(chat_reply("y" * 3_000_000 + "z" * 200_000, USAGE))
    raw_deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    for coding, packed, want in (
            ("gzip", gzip.compress(text[:1000]) + gzip.compress(text[1000:]), text),
            ("deflate", zlib.compress(text), text),
            ("deflate", raw_deflate.compress(text) + raw_deflate.flush(), text)):
        inflate = Inflate.for_encoding(coding)
        assert inflate is not None
        pieces = [p for i in range(0, len(packed), 777) for p in inflate.feed(packed[i:i + 777])]
        assert max(map(len, pieces)) <= INFLATE_PIECE and b"".join(pieces) == want, coding


async def test_usage_split_across_chunks(gateway: GatewayFactory, odd: str) -> None:
    """The usage event arriving in three chunks, cut inside its "usage" key, is read."""
    gw = await gateway(upstream_url=f"{odd}/trickle")
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        got = [ch.usage async for ch in stream if ch.usage is not None]
    assert len(got) == 1
    ev = (await gw.wait_mem(1))[-1]
    assert usage_of(ev) == {"usage_in": got[0].prompt_tokens, "usage_cached": 1024,
                            "usage_out": got[0].completion_tokens}


async def test_huge_body_usage_at_its_end_or_cleanly_absent(
    gateway: GatewayFactory, odd: str
) -> None:
    """A 6 MiB answer: its usage at the end (where every provider writes it) is found in
    the kept tail; a usage at its start is not looked for: no fields, the answer whole."""
    gw = await gateway(upstream_url=f"{odd}/huge")
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        a = await c.chat.completions.create(model="gpt-4o-mini",
                                            messages=[{"role": "user", "content": "hi"}])
        b = await c.chat.completions.create(model="gpt-4o-mini", user="usage-first",
                                            messages=[{"role": "user", "content": "hi"}])
    assert len(a.choices[0].message.content or "") == len(b.choices[0].message.content or "")
    ev = await gw.wait_mem(2)
    assert usage_of(ev[0]) == {"usage_in": 1234, "usage_cached": 1024, "usage_out": 56}
    assert usage_of(ev[1]) == {} and ev[1]["status"] == "200"


def test_reader_memory_is_bounded() -> None:
    """Reading a 32 MiB JSON answer and a 32 MiB event line holds a bounded amount,
    however big the answer (tracemalloc's peak, the chunks themselves excluded)."""
    piece = b"x" * 65536
    for wire, sse, head, tail in (
        ("openai_chat", False, b'{"choices":[{"message":{"content":"',
         b'"}}],"usage":' + orjson.dumps(USAGE) + b"}"),
        ("openai_responses", True,
         b'event: response.completed\ndata: {"type":"response.completed","response":'
         b'{"output":[{"text":"',
         b'"}],"usage":{"input_tokens":9,"output_tokens":2}}}\n\n'),
    ):
        reader = UsageReader(wire, sse)
        tracemalloc.start()
        reader.feed(head)
        for _ in range(512):
            reader.feed(piece)
        reader.feed(tail)
        got = reader.result()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert got is not None and got["input"] in (1234, 9)
        assert peak < 2 * max(BODY_BYTES, LINE_BYTES) + 4 * 65536, (wire, peak)


def test_only_2xx_json_and_event_streams_are_read() -> None:
    """An error answer, another content type or an unknown wire gets no reader."""
    json_h = {"Content-Type": "application/json"}
    assert reader_for("openai_chat", 200, json_h) is not None
    assert reader_for("openai_chat", 400, json_h) is None
    assert reader_for("openai_chat", 200, {"Content-Type": "text/plain"}) is None
    assert reader_for("passthrough", 200, json_h) is None
    br = UsageReader("openai_chat", False, "br")  # not inflated here: no usage, no error
    br.feed(orjson.dumps(chat_reply("x", USAGE)))
    assert br.result() is None


# --------------------------------------------------------------------------- property

texts = st.lists(st.sampled_from(['a', ' ', '"', '\\', '\n', '{', '}', '"usage":', ':',
                                 'é', 'data: ', '"usage":{"prompt_tokens":1}']),
                 max_size=12).map("".join)
counts = st.integers(min_value=0, max_value=10**7)


Stream = tuple[str, bytes, dict[str, int], tuple[str, str]]


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    """One wire's SSE stream with text deltas that spell usage-like bytes, the usage at
    its documented place, the normalised usage it must read as, and the (model, id) the
    answer names (a chat stream: on every event; usage too only with include_usage)."""
    wire = draw(st.sampled_from(["openai_chat", "openai_responses", "anthropic_messages"]))
    deltas = draw(st.lists(texts, max_size=6))
    i, c, o, w = draw(counts), draw(counts), draw(counts), draw(counts)
    model, ident = draw(texts.filter(bool)), draw(texts.filter(bool))
    named = {"model": model, "id": ident}
    ev: list[bytes] = []
    if wire == "openai_chat":
        for t in deltas:
            ev.append(b"data: " + orjson.dumps({**named, "choices": [{"delta": {"content": t}}],
                                                "usage": None}) + b"\n\n")
        ev.append(b"data: " + orjson.dumps({**named, "choices": [], "usage": {
            "prompt_tokens": i, "completion_tokens": o,
            "prompt_tokens_details": {"cached_tokens": c}}}) + b"\n\ndata: [DONE]\n\n")
        want = {"input": i, "cached": c, "output": o}
    elif wire == "openai_responses":
        ev.append(b"event: response.created\ndata: " + orjson.dumps(
            {"type": "response.created", "response": {"usage": None}}) + b"\n\n")
        for t in deltas:
            ev.append(b"event: response.output_text.delta\ndata: " + orjson.dumps(
                {"type": "response.output_text.delta", "delta": t}) + b"\n\n")
        ev.append(b"event: response.completed\ndata: " + orjson.dumps(
            {"type": "response.completed", "response": {
                **named, "output": [{"content": [{"text": "".join(deltas)}]}],
                "usage": {"input_tokens": i, "output_tokens": o,
                          "input_tokens_details": {"cached_tokens": c}}}}) + b"\n\n")
        want = {"input": i, "cached": c, "output": o}
    else:
        ev.append(b"event: message_start\ndata: " + orjson.dumps(
            {"type": "message_start", "message": {**named, "usage": {
                "input_tokens": i, "cache_read_input_tokens": c,
                "cache_creation_input_tokens": w, "output_tokens": 1}}}) + b"\n\n")
        for t in deltas:
            ev.append(b"event: content_block_delta\ndata: " + orjson.dumps(
                {"type": "content_block_delta", "delta": {"type": "text_delta",
                                                          "text": t}}) + b"\n\n")
        ev.append(b"event: message_delta\ndata: " + orjson.dumps(
            {"type": "message_delta", "usage": {"output_tokens": o}}) + b"\n\n")
        ev.append(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        want = {"input": i + c + w, "cached": c, "output": o, "cache_write": w}
    crlf = draw(st.booleans())
    raw = b"".join(ev)
    return wire, raw.replace(b"\n", b"\r\n") if crlf else raw, want, (model, ident)


@given(streams(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
@example(("openai_chat", b'data: {"id":"c1","model":"m","choices":[],"usage":{'
          b'"prompt_tokens":5,"completion_tokens":1}}\n\ndata: [DONE]\n\n',
          {"input": 5, "output": 1}, ("m", "c1")), [3, 9])
def test_any_chunking_reads_the_same_usage(stream: Stream, cuts: list[int]) -> None:
    """However the same SSE stream is cut into chunks, the usage, model and id read are
    the ones it carries (deltas whose text spells `"usage"`, `data: ` or newlines, a model
    name with quotes or backslashes change nothing)."""
    wire, raw, want, named = stream
    reader = UsageReader(wire, sse=True)
    at = 0
    for cut in sorted({min(c, len(raw)) for c in cuts}):
        reader.feed(raw[at:cut])
        at = cut
    reader.feed(raw[at:])
    assert reader.result() == want
    assert (reader.model, reader.id) == named


def test_model_and_id_of_a_cut_answer_come_from_its_head() -> None:
    """A JSON answer or a Responses final event too long to hold: the model and id are
    the first ones of its head (where providers write them), the usage from its tail;
    one that names neither has none."""
    big = "x" * (2 * max(BODY_BYTES, LINE_BYTES))
    reader = UsageReader("openai_chat", False)
    reader.feed(orjson.dumps({**chat_reply(big, USAGE), "id": "chatcmpl-\"q\"",
                              "model": "gpt-4o-2024-08-06"}))
    assert reader.result() == {"input": 1234, "cached": 1024, "output": 56}
    assert (reader.model, reader.id) == ("gpt-4o-2024-08-06", 'chatcmpl-"q"')
    final = {"type": "response.completed", "sequence_number": 9, "response": {
        "id": "resp_1", "object": "response", "model": "o3-2025", "output": [{
            "id": "msg_9", "content": [{"text": big}]}],
        "usage": {"input_tokens": 9, "output_tokens": 2}}}
    reader = UsageReader("openai_responses", True)
    reader.feed(b"event: response.completed\ndata: " + orjson.dumps(final) + b"\n\n")
    assert reader.result() == {"input": 9, "output": 2}
    assert (reader.model, reader.id) == ("o3-2025", "resp_1")
    reader = UsageReader("openai_chat", False)
    reader.feed(orjson.dumps({"choices": [{"message": {"content": big}}], "usage": USAGE}))
    assert reader.result() is not None and (reader.model, reader.id) == (None, None)


# --------------------------------------------------------------------------- stats

async def test_stats_reads_sent_vs_original_and_cached_share(
    gateway: GatewayFactory, mock: str, tmp_path: Path
) -> None:
    """`memgate stats` on the gateway's own [mem] lines: per session the tokens sent
    (the provider's usage_in) against the client's original size (est_tokens) and the
    cached share; JSON log lines and console ones give the same table."""
    on = {"enable_eviction": True, "budget": {"max_tokens": 4000, "max_chars": None,
                                              "max_messages": None, "max_turns": None},
          "eviction": {"recall_share": 0}}  # the stable prefix alone: the cache's part
    for fmt in ("console", "json"):
        gw = await gateway(memory=on, upstream_url=mock, fmt=fmt)
        history = chat_history(30)
        history[0] = {"role": "system", "content": "You are a terse build assistant. " * 200}
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                      max_retries=0) as c:
            got = []
            for n in range(3):  # the session grows; the kept cut is a cached prefix
                msgs = history + [{"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": f"next {n}"}] * n
                r = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs,  # type: ignore[arg-type]
                                                    extra_headers={"X-Session-Id": "grow"})
                assert r.usage is not None
                got.append(r.usage)
        text = gw.log.getvalue()
        lines = [ln for ln in text.splitlines() if "mem" in ln]
        assert len(lines) >= 3
        if fmt == "console":  # the plan cut: the estimate of what went is on the line too
            for ev in gw.mem_events():
                assert int(ev["dropped"]) > 0
                assert 0 < int(ev["est_sent_tokens"]) < int(ev["est_tokens"])
        report = stats.measure(["-"], load_rules(ROOT / "rules" / "gateway.yaml", {}),
                               simulate=False, stdin=io.StringIO(text))
        s = stats.summary(report)
        row = s["usage"]["sessions"][0]
        sent = sum(u.prompt_tokens for u in got)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in got
                     if u.prompt_tokens_details)
        original = sum(sample.tokens for sample in report.samples)
        assert row["requests"] == 3 and row["with_usage"] == 3
        assert row["sent_tokens"] == sent and row["original_tokens"] == original
        assert row["saved_share"] == round(1 - sent / original, 4) and sent < original
        assert row["cached_share"] == round(cached / sent, 4) and cached > 0
        assert s["usage"]["total"]["sent_tokens"] == sent
        table = stats.render_table(s)
        assert "provider usage" in table and f"{cached / sent:.0%}" in table


def test_stats_without_usage_uses_the_estimate_sent() -> None:
    """A [mem] line without usage counts memgate's estimate of what was forwarded
    (est_sent_tokens when the plan cut, else est_tokens); old lines read as before."""
    lines = "\n".join([
        "[mem] session=a hist_msgs=9 hist_chars=900 est_tokens=1000 est_sent_tokens=400",
        "[mem] session=a hist_msgs=3 hist_chars=90 est_tokens=100",
        "[mem] session=b hist_msgs=3 hist_chars=90 est_tokens=300 usage_in=280 usage_cached=0",
    ])
    report = stats.measure(["-"], load_rules(ROOT / "rules" / "gateway.yaml", {}),
                           simulate=False, stdin=io.StringIO(lines))
    u = stats.summary(report)["usage"]
    a, b = u["sessions"]
    assert (a["session"], a["sent_tokens"], a["original_tokens"]) == ("a", 500, 1100)
    assert a["cached_share"] is None and a["with_usage"] == 0
    assert (b["sent_tokens"], b["cached_share"]) == (280, 0.0)
    assert u["total"]["sent_tokens"] == 780 and u["total"]["requests"] == 3
