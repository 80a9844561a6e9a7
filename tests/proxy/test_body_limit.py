"""One body limit on every route: over limits.max_body_bytes (declared, as it arrives, or
once decoded) is a 413 in the caller's error shape before anything is forwarded, on the
chat routes and on the relayed ones (embeddings, file uploads) alike; at or under it,
the body goes upstream as the client sent it."""

from __future__ import annotations

import asyncio
import gzip
import random
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import GatewayFactory
from tests.proxy.test_bounded import (
    RawUpstream,
    http_post,
    port_of,
    raw_http,
    split_response,
)


@pytest.fixture
async def recorder(aiohttp_server: Any) -> RawUpstream:
    """The upstream: records every request's bytes as they arrived (nothing decoded)."""
    rec = RawUpstream()
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    rec.server = await aiohttp_server(app, auto_decompress=False)
    return rec


LIMIT = 65536  # the test config: 64 KiB
BOUNDARY = "memgate-limit-test"


def embeddings(pad: bytes) -> bytes:
    return b'{"model": "text-embedding-3-small", "input": "' + pad + b'"}'


def upload(pad: bytes) -> bytes:
    """A /v1/files upload as the SDKs send it: multipart/form-data."""
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
            f"batch\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"batch.jsonl\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            ).encode() + pad + f"\r\n--{BOUNDARY}--\r\n".encode()


def chat(pad: bytes) -> bytes:
    return (b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "'
            + pad + b'"}]}')


# path, body builder, Content-Type; the first two are relayed, the last intercepted
ROUTES: dict[str, tuple[str, Callable[[bytes], bytes], str]] = {
    "embeddings": ("/v1/embeddings", embeddings, "application/json"),
    "files": ("/v1/files", upload, f"multipart/form-data; boundary={BOUNDARY}"),
    "chat": ("/v1/chat/completions", chat, "application/json"),
}


def sized(route: str, size: int, fill: Callable[[int], bytes] = lambda n: b"x" * n) -> bytes:
    """The route's body, exactly `size` bytes long."""
    build = ROUTES[route][1]
    body = build(fill(size - len(build(b""))))
    assert len(body) == size
    return body


def chunked_post(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """`body` sent with Transfer-Encoding: chunked (no Content-Length), 1000 bytes a chunk."""
    head = {"Host": "127.0.0.1", "Transfer-Encoding": "chunked", "Connection": "close",
            **headers}
    out = [f"POST {path} HTTP/1.1\r\n".encode(),
           "".join(f"{k}: {v}\r\n" for k, v in head.items()).encode(), b"\r\n"]
    for i in range(0, len(body), 1000):
        part = body[i:i + 1000]
        out += [f"{len(part):x}\r\n".encode(), part, b"\r\n"]
    out.append(b"0\r\n\r\n")
    return b"".join(out)


async def send(gw: Any, route: str, sent: bytes, framing: str, coding: str = ""
               ) -> tuple[int, bytes]:
    path, _, ctype = ROUTES[route]
    headers = {"Content-Type": ctype, **({"Content-Encoding": coding} if coding else {})}
    request = (http_post(path, sent, headers) if framing == "length"
               else chunked_post(path, sent, headers))
    status, _, answer = split_response(await raw_http(port_of(gw), request))
    return status, answer


def assert_refused(status: int, answer: bytes, flavor: str = "openai") -> None:
    assert status == 413, (status, answer[:200])
    err = orjson.loads(answer)
    if flavor == "anthropic":
        assert err["type"] == "error" and err["error"]["type"] == "request_too_large"
    else:
        assert err["error"]["code"] == "payload_too_large"
    assert str(LIMIT) in err["error"]["message"]
    assert "limits.max_body_bytes" in err["error"]["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_over_the_limit_is_413_and_never_forwarded(
        gateway: GatewayFactory, recorder: RawUpstream, route: str, framing: str) -> None:
    """One byte over the limit, with a Content-Length or chunked, and a gzip body whose
    decoded size is over it (its compressed bytes far under): a 413 in OpenAI's shape,
    and the upstream sees nothing of any of them."""
    gw = await gateway(upstream_url=recorder.url, limits={"max_body_bytes": LIMIT})
    assert_refused(*await send(gw, route, sized(route, LIMIT + 1), framing))
    bomb = gzip.compress(sized(route, LIMIT + 1))
    assert len(bomb) < 1024
    assert_refused(*await send(gw, route, bomb, framing, "gzip"))
    # a declared length far over the limit is refused from the headers alone
    assert_refused(*await send(gw, route, sized(route, 4 * LIMIT), framing))
    assert recorder.received == []


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_at_and_under_the_limit_go_up_byte_for_byte(
        gateway: GatewayFactory, recorder: RawUpstream, route: str, framing: str) -> None:
    """A body exactly at the limit and one under it are forwarded as the client sent them;
    a gzip one decoding to exactly the limit too (relayed compressed on the relayed
    routes, decoded on the chat route, as before)."""
    gw = await gateway(upstream_url=recorder.url, limits={"max_body_bytes": LIMIT})
    for size in (LIMIT, LIMIT - 1, 400):
        body = sized(route, size)
        status, answer = await send(gw, route, body, framing)
        assert status == 200, (size, status, answer[:200])
        assert recorder.received[-1]["raw"] == body
    body = sized(route, LIMIT)
    status, answer = await send(gw, route, gzip.compress(body), framing, "gzip")
    assert status == 200, answer[:200]
    got = recorder.received[-1]
    if route == "chat":
        assert got["raw"] == body and "Content-Encoding" not in got["headers"]
    else:
        assert got["raw"] == gzip.compress(body)
        assert got["headers"]["Content-Encoding"] == "gzip"
    assert len(recorder.received) == 4


async def test_anthropic_caller_gets_its_own_413(
        gateway: GatewayFactory, recorder: RawUpstream) -> None:
    """The Anthropic client (anthropic-version) is refused in Anthropic's error shape, on
    /v1/messages and on a relayed route alike."""
    gw = await gateway(upstream_url=recorder.url, limits={"max_body_bytes": LIMIT})
    body = b'{"model": "claude", "max_tokens": 5, "x": "' + b"y" * LIMIT + b'"}'
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/files"):
        status, _, answer = split_response(await raw_http(port_of(gw), http_post(
            path, body, {"anthropic-version": "2023-06-01"})))
        assert_refused(status, answer, "anthropic")
    assert recorder.received == []


async def test_an_upload_under_the_limit_streams_as_it_arrives(
        gateway: GatewayFactory, aiohttp_server: Any) -> None:
    """A relayed upload with a Content-Length within the limit is not held until it is
    whole: the upstream reads its first bytes while the client has sent only half."""
    first_bytes = asyncio.Event()
    got: list[bytes] = []

    async def files(request: web.Request) -> web.Response:
        got.append(await request.content.readany())
        first_bytes.set()
        got.append(await request.read())
        return web.json_response({"id": "file-1", "object": "file"})

    app = web.Application()
    app.router.add_post("/v1/files", files)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"),
                       limits={"max_body_bytes": LIMIT})
    body = sized("files", LIMIT)
    request = http_post("/v1/files", body, {"Content-Type": ROUTES["files"][2]})
    half = len(request) - len(body) // 2
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(gw))
    try:
        writer.write(request[:half])
        await writer.drain()
        await asyncio.wait_for(first_bytes.wait(), 5)  # before the second half is sent
        writer.write(request[half:])
        status, _, _ = split_response(await asyncio.wait_for(reader.read(), 5))
    finally:
        writer.close()
    assert status == 200 and b"".join(got) == body


fills: dict[str, Callable[[random.Random], Callable[[int], bytes]]] = {
    "repetitive": lambda rng: lambda n: b"x" * n,
    "text": lambda rng: lambda n: bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz ")
                                        for _ in range(n)),
    # only on the relayed routes (not JSON): gzip makes it larger than it decodes to
    "incompressible": lambda rng: lambda n: rng.randbytes(n),
}
PROPERTY_LIMIT = 4096


@pytest.fixture
async def small_limit_gateway(gateway: GatewayFactory, recorder: RawUpstream) -> Any:
    """One gateway for every example of the property (a 4 KiB limit)."""
    return await gateway(upstream_url=recorder.url,
                         limits={"max_body_bytes": PROPERTY_LIMIT})


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(sorted(ROUTES)), framing=st.sampled_from(["length", "chunked"]),
       coding=st.sampled_from(["", "gzip"]), fill=st.sampled_from(sorted(fills)),
       delta=st.integers(-80, 80), seed=st.integers(0, 2**16))
async def test_refused_exactly_when_over_on_either_count(
        small_limit_gateway: Any, recorder: RawUpstream, route: str, framing: str,
        coding: str, fill: str, delta: int, seed: int) -> None:
    """Any route, framing and encoding: a 413 exactly when what arrives or what it decodes
    to is over the limit, and then nothing reaches the upstream; otherwise the upstream
    gets the client's bytes (the chat route: decoded)."""
    if fill == "incompressible" and route == "chat":
        fill = "text"
    gw = small_limit_gateway
    decoded = sized(route, PROPERTY_LIMIT + delta, fills[fill](random.Random(seed)))
    sent = gzip.compress(decoded) if coding else decoded
    before = len(recorder.received)
    status, answer = await send(gw, route, sent, framing, coding)
    if max(len(sent), len(decoded)) > PROPERTY_LIMIT:
        assert status == 413, (status, answer[:200])
        assert len(recorder.received) == before
    else:
        assert status == 200, (status, answer[:200])
        assert len(recorder.received) == before + 1
        expected = decoded if route == "chat" else sent
        assert recorder.received[-1]["raw"] == expected
