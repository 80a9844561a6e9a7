"""Bounded inputs: compressed bodies, config files, paths, log values, malformed HTTP."""

from __future__ import annotations

import asyncio
import gzip
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.rules import load_rules
from gateway.errors import RulesError
from tests.conftest import ROOT, SECRET, GatewayFactory, Upstream, sample
from tests.proxy.test_faults import start_serve


class RawUpstream:
    """An upstream that records what arrived on the wire: no decompression, raw path."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.received.append({"path": request.raw_path, "raw": raw,
                              "headers": request.headers.copy()})
        if request.path.endswith("/chat/completions"):
            return web.json_response({"id": "chatcmpl-raw", "object": "chat.completion",
                                      "choices": [], "model": "gpt-4o-mini"})
        return web.Response(body=b"relayed", content_type="text/plain")


@pytest.fixture
async def raw_upstream(aiohttp_server: Any) -> RawUpstream:
    rec = RawUpstream()
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", rec.handle)
    rec.server = await aiohttp_server(app, auto_decompress=False)
    return rec


async def raw_http(port: int, request: bytes, timeout_s: float = 5.0) -> bytes:
    """Send bytes as they are (no client normalises the path) and read the whole answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def http_post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = {"Host": "127.0.0.1", "Content-Type": "application/json",
            "Content-Length": str(len(body)), "Connection": "close", **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"POST {path} HTTP/1.1\r\n{lines}\r\n".encode() + body


def split_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


def port_of(gw: Any) -> int:
    port: int = gw.server.port
    return port


# --------------------------------------------------------------------------- 5: encodings


def chat_body(n_chars: int = 0) -> bytes:
    body = sample("chat_short")
    body["messages"][-1]["content"] += "x" * n_chars
    return orjson.dumps(body)


async def test_gzip_bomb_is_413_on_the_decoded_size(
        gateway: GatewayFactory, raw_upstream: RawUpstream) -> None:
    """A 48 KB gzip body that inflates past limits.max_body_bytes is a 413 in the API's
    error shape, measured on what it decodes to; nothing reaches the upstream."""
    gw = await gateway(upstream_url=raw_upstream.url, limits={"max_body_bytes": 65536})
    bomb = gzip.compress(chat_body(48 << 20), 9)
    assert len(bomb) < 65536
    for path, flavor in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        status, _, body = split_response(await raw_http(port_of(gw), http_post(
            path, bomb, {"Content-Encoding": "gzip"})))
        assert status == 413
        err = orjson.loads(body)
        if flavor == "openai":
            assert err["error"]["code"] == "payload_too_large"
            assert "65536" in err["error"]["message"]
        else:
            assert err["type"] == "error" and err["error"]["type"] == "request_too_large"
    assert raw_upstream.received == []


@pytest.mark.parametrize("encoding,encode", [
    ("gzip", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),  # RFC 1950: zlib wrapper
    ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients send it
    ("GZIP", lambda b: gzip.compress(b[:20]) + gzip.compress(b[20:])),  # two members
])
async def test_decoded_body_goes_up_without_encoding_header(
        gateway: GatewayFactory, raw_upstream: RawUpstream, encoding: str, encode: Any) -> None:
    """A compressed chat body is decoded, and forwarded as what it decodes to: no
    Content-Encoding header, a Content-Length that matches."""
    gw = await gateway(upstream_url=raw_upstream.url)
    body = chat_body()
    status, _, _ = split_response(await raw_http(port_of(gw), http_post(
        "/v1/chat/completions", encode(body), {"Content-Encoding": encoding})))
    assert status == 200
    got = raw_upstream.received[-1]
    assert got["raw"] == body
    assert "Content-Encoding" not in got["headers"]
    assert got["headers"]["Content-Length"] == str(len(body))
    (event,) = await gw.wait_mem(1)
    assert event["hist_msgs"] == str(len(sample("chat_short")["messages"]))


async def test_encoding_sent_on_two_lines_is_undone_twice(
        gateway: GatewayFactory, raw_upstream: RawUpstream) -> None:
    """`Content-Encoding: gzip` twice is `gzip, gzip` (RFC 9110): both layers undone, the
    upstream gets the JSON (not still-gzipped bytes without an encoding header)."""
    gw = await gateway(upstream_url=raw_upstream.url)
    body = chat_body()
    request = http_post("/v1/chat/completions", gzip.compress(gzip.compress(body)))
    head, _, rest = request.partition(b"\r\n\r\n")
    request = head + b"\r\nContent-Encoding: gzip\r\nContent-Encoding: gzip\r\n\r\n" + rest
    status, _, _ = split_response(await raw_http(port_of(gw), request))
    assert status == 200
    got = raw_upstream.received[-1]
    assert got["raw"] == body and "Content-Encoding" not in got["headers"]


async def test_passthrough_relays_compressed_body_as_sent(
        gateway: GatewayFactory, raw_upstream: RawUpstream) -> None:
    """Other routes relay the client's bytes: the compressed body whole, its encoding
    header kept (it was cut to the compressed length of the decoded bytes)."""
    gw = await gateway(upstream_url=raw_upstream.url)
    payload = orjson.dumps({"input": "y" * 200_000, "model": "text-embedding-3-small"})
    packed = gzip.compress(payload)
    status, _, body = split_response(await raw_http(port_of(gw), http_post(
        "/v1/embeddings", packed, {"Content-Encoding": "gzip"})))
    assert (status, body) == (200, b"relayed")
    got = raw_upstream.received[-1]
    assert got["raw"] == packed
    assert got["headers"]["Content-Encoding"] == "gzip"
    # chunked (no Content-Length): read up to the limit, relayed as sent too
    chunked = (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + f"{len(packed):x}\r\n".encode() + packed + b"\r\n0\r\n\r\n")
    status, _, _ = split_response(await raw_http(port_of(gw), chunked))
    assert status == 200 and raw_upstream.received[-1]["raw"] == packed


@pytest.mark.parametrize("encoding,body,status,code", [
    ("gzip", b"\x1f\x8b\x08\x00garbage-not-gzip", 400, "invalid_request"),
    ("gzip", gzip.compress(b'{"model": "gpt-4o-mini", "messages": []}')[:-12], 400,
     "invalid_request"),  # truncated
    ("deflate", b"not deflate at all", 400, "invalid_request"),
    ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
    ("zstd", b"(\xb5/\xfd", 415, "unsupported_content_encoding"),
])
async def test_bad_or_unknown_encoding_is_a_shaped_error(
        gateway: GatewayFactory, raw_upstream: RawUpstream, encoding: str, body: bytes,
        status: int, code: str) -> None:
    """Invalid gzip/deflate is a 400, an encoding the gateway cannot read a 415: JSON in
    the API's shape (the Anthropic route too), never a bare 500 or plain text."""
    gw = await gateway(upstream_url=raw_upstream.url)
    got, headers, out = split_response(await raw_http(port_of(gw), http_post(
        "/v1/chat/completions", body, {"Content-Encoding": encoding})))
    assert got == status and headers["content-type"].startswith("application/json")
    assert orjson.loads(out)["error"]["code"] == code
    got, _, out = split_response(await raw_http(port_of(gw), http_post(
        "/v1/messages", body, {"Content-Encoding": encoding})))
    assert got == status and orjson.loads(out)["type"] == "error"
    assert raw_upstream.received == []


# --------------------------------------------------------------------------- 6, 7: config

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""
DEEP = "memory: " + "[" * 5000 + "]" * 5000 + "\n"
BAD_FILES = {
    "billion_laughs": BILLION_LAUGHS,
    "deep": DEEP,
    "deep_block": "".join(" " * i + f"k{i}:\n" for i in range(600)),  # 180 KB
    "recursive_alias": "memory: &m\n  budget: *m\n",
    "huge": "listen:\n  host: " + "x" * (2 << 20) + "\n",
    "empty": "",
    "comments_only": "# nothing here\n",
    "null": "~\n",
    # a second block pasted below the first: the parse would keep it alone
    "duplicate_key": "memory:\n  enable_eviction: true\nlisten: {port: 8080}\n"
                     "memory:\n  budget: {max_tokens: 100}\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_hostile_config_is_refused_quickly(name: str, tmp_path: Path) -> None:
    """Alias bombs, deep nesting, recursive aliases, oversized and empty files: a
    RulesError naming the bound, in well under a second (also `memgate check-config`)."""
    from gateway.cli.main import main

    path = tmp_path / "gateway.yaml"
    path.write_text(BAD_FILES[name], encoding="utf-8")
    t0 = time.perf_counter()
    with pytest.raises(RulesError) as exc:
        load_rules(path, {})
    assert time.perf_counter() - t0 < 1.0
    assert exc.value.file == str(path)
    t0 = time.perf_counter()
    assert main(["check-config", str(path)]) == 2
    assert time.perf_counter() - t0 < 1.0


def test_too_many_nodes_without_aliases_are_refused(tmp_path: Path) -> None:
    """The node bound holds for plain files too: a 24 KB list of 12,000 numbers."""
    path = tmp_path / "gateway.yaml"
    path.write_text("memory:\n  x: [" + ",".join(["1"] * 12_000) + "]\n", encoding="utf-8")
    with pytest.raises(RulesError, match="more than 10000 nodes"):
        load_rules(path, {})


def test_small_aliases_still_load(tmp_path: Path) -> None:
    """Aliases are not refused as such: a config reusing a small mapping loads."""
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "upstreams:\n"
        "  - {name: openai, base_url: 'http://127.0.0.1:1', paths: &all ['/*'], <<: &t\n"
        "      {connect_timeout_s: 3, read_timeout_s: 9}}\n"
        "  - {name: other, base_url: 'http://127.0.0.1:2', paths: *all, <<: *t}\n",
        encoding="utf-8")
    rules = load_rules(path, {})
    assert [(u.connect_timeout_s, u.read_timeout_s, u.paths) for u in rules.upstreams] == [
        (3.0, 9.0, ("/*",))] * 2


@pytest.mark.parametrize("name", ["billion_laughs", "deep", "empty", "null"])
async def test_reload_refuses_hostile_file_and_keeps_watching(
        gateway: GatewayFactory, upstream: Upstream, name: str) -> None:
    """A hostile or empty file on reload: the loop keeps answering, the refusal is logged
    with its reason, the last good config keeps serving, and the next valid edit (within
    the poll interval) is applied."""
    gw = await gateway()
    good = gw.state.rules
    text = gw.config.read_text()
    gw.config.write_text(BAD_FILES[name])
    deadline = time.monotonic() + 5
    import aiohttp

    async with aiohttp.ClientSession() as s:
        while "config_reload result=failed" not in gw.log.getvalue():
            t0 = time.monotonic()
            async with s.get(gw.url + "/healthz") as r:
                assert r.status == 200
            assert time.monotonic() - t0 < 0.5  # the event loop is not frozen
            assert time.monotonic() < deadline, gw.log.getvalue()
            await asyncio.sleep(0.02)
    failed = [ln for ln in gw.log.getvalue().splitlines() if "result=failed" in ln]
    assert "reason=" in failed[0]
    assert gw.state.rules is good
    gw.config.write_text(text.replace("enable_eviction: false", "enable_eviction: true"))
    deadline = time.monotonic() + 2
    while gw.state.rules.memory.mode != "on":
        assert time.monotonic() < deadline, gw.log.getvalue()
        await asyncio.sleep(0.02)
    assert "config_reload result=ok" in gw.log.getvalue()


def test_startup_with_empty_config_is_refused(tmp_path: Path) -> None:
    """`memgate serve --config empty.yaml` exits 2 with a message saying why; `{}` is the
    way to ask for all defaults."""
    from gateway.cli.main import main

    empty = tmp_path / "empty.yaml"
    empty.write_text("\n")
    assert main(["serve", "--config", str(empty), "--port", "0"]) == 2
    with pytest.raises(RulesError, match="empty"):
        load_rules(empty, {})
    empty.write_text("{}\n")
    assert load_rules(empty, {}).memory.mode == "shadow"


# --------------------------------------------------------------------------- 8: dot segments

ESCAPES = [
    "/v1/messages/../../../../v1/organizations/keys",
    "/v1/messages/%2e%2e/%2E%2E/v1/organizations/keys",
    "/v1/messages/..%2f..%2fv1/organizations/keys",
    "/v1/messages/..\\..\\v1/organizations/keys",
    "/v1/../../etc/passwd",
    "/v1/./../etc/passwd",
    "/v1/chat/completions/..",
]


@pytest.mark.parametrize("path", ESCAPES)
async def test_dot_segments_never_leave_the_base_path(
        gateway: GatewayFactory, raw_upstream: RawUpstream, path: str) -> None:
    """A path with `.`/`..` segments (also percent-encoded, or with backslashes) is a 400
    in the API's shape before routing: it never gets the Anthropic route's injected key,
    never reaches a path outside the upstream's base URL."""
    gw = await gateway(
        upstream_url=raw_upstream.url + "/prefix/v1", env={"MEMGATE_TEST_KEY": SECRET},
        upstreams=[
            {"name": "anthropic", "base_url": raw_upstream.url + "/anthropic",
             "paths": ["/v1/messages*"], "api_key_env": "MEMGATE_TEST_KEY",
             "api_key_header": "x-api-key"},
            {"name": "openai", "base_url": raw_upstream.url + "/prefix/v1", "paths": ["/*"]},
        ])
    for method in ("GET", "POST"):
        req = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
               "Connection: close\r\n\r\n{}").encode()
        status, headers, body = split_response(await raw_http(port_of(gw), req))
        assert status == 400, (status, body)
        assert headers["content-type"].startswith("application/json")
        err = orjson.loads(body)
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        else:
            assert err["error"]["code"] == "invalid_path"
    assert raw_upstream.received == []


_SEGMENTS = st.sampled_from(["a", "v1", ".", "..", "...", ".a", "a.", "%2e", "%2E%2e", "%2e.",
                             "..%2f..", "a%2f..", "..%5c..", "\\..", "", "%252e%252e"])


@given(segments=st.lists(_SEGMENTS, max_size=8))
def test_no_accepted_path_leaves_the_base(segments: list[str]) -> None:
    """Any path the gateway accepts (as aiohttp decodes it) stays under the upstream's base
    path once the upstream client (yarl) has built and normalised the URL."""
    import yarl

    from gateway.config.schema import Upstream as Up
    from gateway.config.schema import target_url
    from gateway.proxy.upstream import has_dot_segment

    path = "/" + "/".join(segments)
    if has_dot_segment(yarl.URL.build(path=path, encoded=True).path):  # refused: a 400
        return
    sent = yarl.URL(target_url(Up("openai", "http://127.0.0.1:1/prefix/v1"), path))
    assert sent.path == "/prefix/v1" or sent.path.startswith("/prefix/v1/"), (path, sent)


async def test_plain_paths_still_reach_the_base_path(
        gateway: GatewayFactory, raw_upstream: RawUpstream) -> None:
    """Dots inside a segment (a model name) are no dot-segment: relayed under the base."""
    base = raw_upstream.url + "/prefix/v1"  # MEMGATE_UPSTREAM overrides the config's
    gw = await gateway(upstream_url=base, upstreams=[
        {"name": "openai", "base_url": base, "paths": ["/*"]}])
    status, _, body = split_response(await raw_http(port_of(gw), (
        b"GET /v1/models/gpt-4.1..mini?x=/../ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")))
    assert status == 200, body
    assert raw_upstream.received[-1]["path"] == "/prefix/v1/models/gpt-4.1..mini?x=/../"


# --------------------------------------------------------------------------- 11: log forging

FORGING = "gpt-4o\r\n[mem] session=forged status=200\x1b[31m\u2028\x85\x0b\x0c\x7f\u202e\x00"


async def test_control_characters_cannot_forge_mem_lines(
        gateway: GatewayFactory, upstream: Upstream) -> None:
    """A model name carrying CR/LF, ESC, U+2028, NEL, VT, FF, DEL, a bidi override or NUL
    stays inside one quoted, escaped value of one printable-ASCII [mem] line."""
    import aiohttp

    gw = await gateway()
    body = {**sample("chat_short"), "model": FORGING}
    async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/chat/completions", data=orjson.dumps(body),
            headers={"Content-Type": "application/json"}) as r:
        assert r.status == 200
    await gw.wait_mem(1)
    lines = gw.log.getvalue().splitlines()  # every separator Python knows: NEL, U+2028, VT
    assert all(" " <= c <= "~" for ln in lines for c in ln), lines
    (line,) = [ln for ln in lines if ln.startswith("[mem] ")]
    quoted = line.split(" model=", 1)[1]
    value, _ = __import__("json").JSONDecoder().raw_decode(quoted)
    assert value == FORGING


# --------------------------------------------------------------------------- 12: parser errors

MALFORMED = [
    # a bare CR after the key
    (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\rX: y"
     "\r\nContent-Length: 0\r\n\r\n"),
    # a NUL after the key
    (f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: {SECRET}\x00\r\nContent-Length: 0"
     "\r\n\r\n"),
    # an 8 KB header
    (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\napi-key: {SECRET}{'a' * 9000}\r\n"
     "Content-Length: 0\r\n\r\n"),
    # a key under a header name the parser refuses
    f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nBad Header: {SECRET}\r\n\r\n",
    # a key in an invalid request line
    f"POST /v1/chat/completions?key={SECRET} HTTP/1.1 junk\r\nHost: x\r\n\r\n",
    f"GET /{SECRET}\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
]


@pytest.mark.slow
async def test_malformed_http_never_echoes_a_key(
        aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`memgate serve` answers malformed requests carrying a key with a JSON 400 that does
    not echo it, and neither its stdout nor its stderr holds the key."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the process runs this checkout's code
    up = web.Application()
    proc, port, log = await start_serve(str((await aiohttp_server(up)).make_url("")), tmp_path)
    try:
        for raw in MALFORMED:
            data = await raw_http(port, raw.encode("latin-1"))
            assert SECRET.encode() not in data, data
            status, headers, body = split_response(data)
            assert status == 400 and headers["content-type"].startswith("application/json")
            error = orjson.loads(body)["error"]
            assert error["code"] == "bad_http_request"
            assert error["type"] == "invalid_request_error"
        # the path, so the API, is unknown here: a body each SDK reads as its own
        for raised in await asyncio.gather(*(asyncio.to_thread(sdk_call, port, api)
                                             for api in ("openai", "anthropic"))):
            assert raised.status_code == 400 and "malformed HTTP request" in raised.message
            assert raised.type == "invalid_request_error"
            assert getattr(raised, "code", "bad_http_request") == "bad_http_request"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
    text = log.read_text(encoding="utf-8", errors="replace")
    assert SECRET not in text and SECRET[:12] not in text, text
    assert text.count("http_bad_request") == len(MALFORMED) + 2


def sdk_call(port: int, api: str) -> Any:
    """The error one SDK raises for a request with a 9 KB header (the parser refuses it)."""
    import anthropic
    import openai

    big = {"x-trace": "a" * 9000}
    url = f"http://127.0.0.1:{port}"
    try:
        if api == "openai":
            openai.OpenAI(base_url=url + "/v1", api_key=SECRET, max_retries=0,
                          default_headers=big).chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        else:
            anthropic.Anthropic(base_url=url, api_key=SECRET, max_retries=0,
                                default_headers=big).messages.create(
                model="claude-sonnet-4-5", max_tokens=8,
                messages=[{"role": "user", "content": "hi"}])
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return e
    raise AssertionError(f"{api}: no error raised")


async def test_handler_exception_is_a_json_500_without_its_text() -> None:
    """An exception escaping a handler under GatewayRunner: a JSON 500 in the API's shape
    and one `http_error` line naming its type and place, not its text (which may hold a
    request's values); a handler timeout is a JSON 504; aiohttp's other error logs are
    one `http_server_error` line."""
    import io

    import aiohttp
    import structlog

    from gateway.observe import logging as mglog
    from gateway.proxy.httpserver import GatewayRunner

    async def boom(request: web.Request) -> web.Response:
        raise ValueError(f"bad value {request.headers['x-api-key']}")

    async def no_response(request: web.Request) -> Any:
        return None

    async def slow(request: web.Request) -> web.Response:
        raise TimeoutError

    stream = io.StringIO()
    mglog.configure("console", "info", stream=stream)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", boom)
    app.router.add_post("/v1/messages", boom)
    app.router.add_get("/slow", slow)
    app.router.add_get("/none", no_response)
    runner = GatewayRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = site.name + "/"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "v1/chat/completions", headers={"x-api-key": SECRET}) as r:
                assert r.status == 500
                assert (await r.json())["error"]["code"] == "internal_error"
            async with s.post(url + "v1/messages", headers={"x-api-key": SECRET}) as r:
                assert r.status == 500 and (await r.json())["type"] == "error"
            async with s.get(url + "slow") as r:
                assert r.status == 504 and (await r.json())["error"]["code"] == "timeout"
            async with s.get(url + "none") as r:  # aiohttp's own log_exception path
                assert r.status == 500
    finally:
        await runner.cleanup()
        structlog.reset_defaults()
    log = stream.getvalue()
    assert SECRET not in log
    assert log.count("http_error status=500 error=ValueError where=test_bounded.py:") == 2
    assert 'http_server_error what="Missing return statement on request handler"' in log


async def test_a_change_is_loaded_once_it_holds_for_a_poll(tmp_path: Path) -> None:
    """The watcher loads a changed file only when the next poll finds it unchanged: a
    file caught between two writes (its first sections written, parsing) is not applied
    with the rest at defaults."""
    import os

    from gateway.config.reload import Reloader

    path = tmp_path / "gateway.yaml"
    full = "memory:\n  enable_eviction: true\nlisten: {port: 8111}\n"
    path.write_text("memory:\n  enable_eviction: false\nlisten: {port: 8111}\n")
    rules = load_rules(path, {})
    swaps: list[Any] = []
    events: list[Any] = []

    class Log:
        def info(self, *a: Any, **k: Any) -> None:
            events.append(k)

        error = info

    r = Reloader(path, {}, rules, lambda old, new: swaps.append(new), Log())
    half = full.split("listen")[0]
    for i, text in enumerate((half, full)):  # each poll finds the file changed again
        path.write_text(text)
        os.utime(path, ns=(10**9 * (i + 1), 10**9 * (i + 1)))
        assert await r.check() is False
    assert swaps == []
    assert await r.check() is True  # unchanged since the last poll: loaded whole
    assert swaps[0].memory.mode == "on" and swaps[0].listen_port == 8111
