"""Forwarding: header hygiene, one pooled session per upstream, streaming relay.

Transport exceptions are mapped to gateway errors here and nowhere else.
The upstream is chosen by config only; nothing the client sends (URL, Host,
headers) can point the gateway anywhere else.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_writer import StreamWriter
from aiohttp.payload import BytesPayload, Payload
from multidict import CIMultiDict

from gateway.config.schema import Upstream, target_url
from gateway.errors import BadRequest, GatewayError, UpstreamTimeout, UpstreamUnreachable
from gateway.observe.relayed import REFUSALS, Relayed
from gateway.observe.usage import Inflate, TooBig, Unreadable, reader_for

HOP_BY_HOP = frozenset(
    (
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
        # the gateway holds the whole body before it sends it: a client's 100-continue
        # was answered here, and passed on it would wait for the upstream's own 100
        "proxy-connection", "expect",
    )
)
# the gateway's own request headers: consumed here, never sent upstream
GATEWAY_HEADERS = frozenset(("x-memgate-admin-token",))
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # how the server hands on a byte not UTF-8


def as_written(v: str) -> str:
    """A response header value or reason phrase as the server can write it: one whose
    bytes are not UTF-8 arrives with lone surrogates, which the server would drop
    (`caf\xe9` relayed as `caf`); its bytes are taken as Latin-1, what such obs-text
    historically is (RFC 9110 5.5), and written as their UTF-8."""
    if v.isascii() or not _NOT_UTF8.search(v):
        return v
    return v.encode("utf-8", "surrogateescape").decode("latin-1")


def hop_by_hop(headers: Any) -> frozenset[str]:
    """HOP_BY_HOP and the headers this message's `Connection` names (RFC 9110 7.6.1)."""
    named = [t.strip().lower() for v in headers.getall("Connection", ()) for t in v.split(",")]
    return HOP_BY_HOP.union(named) if named else HOP_BY_HOP


# the most of a refused answer read (and dropped) to keep its connection for reuse
DISCARD_BYTES = 65_536


# set on a request whose body read_body decoded (the relay then drops Content-Encoding)
DECODED = web.RequestKey("memgate.decoded", bool)
# from this size a body is written after its headers instead of joined to them (a copy)
SEPARATE_WRITE_BYTES = 65_536


class SentBody(BytesPayload):
    """A body as the relay hands it to aiohttp: written whole (aiohttp slices bytes to
    their Content-Length: a copy), a big one after its headers rather than joined to
    them (another), and `on_sent` called once it is with the transport, so what runs
    next on the loop runs after the request has left, not before."""

    def __init__(self, value: bytes, on_sent: Callable[[], None] | None = None) -> None:
        # BytesPayload's own __init__ only adds a warning about bodies over 1 MB
        Payload.__init__(self, value, content_type="application/octet-stream")
        self._size = len(value)  # what aiohttp reads as the Content-Length
        self._on_sent = on_sent

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        body: bytes | memoryview = self._value
        size = len(self._value)
        if content_length is not None and content_length < size:
            body = memoryview(self._value)[:content_length]
        try:
            if size >= SEPARATE_WRITE_BYTES and isinstance(writer, StreamWriter):
                writer.send_headers()
            await writer.write(body)
        finally:
            self.sent()

    def sent(self) -> None:
        """Call on_sent, once (also when the body never went: the caller's work runs)."""
        on_sent, self._on_sent = self._on_sent, None
        if on_sent is not None:
            on_sent()


class StreamEnd:
    """Watches relayed SSE bytes for a terminal event line (`ends`, e.g. b"data: [DONE]").

    Only a line start counts: a newline inside a JSON data line is always escaped, so no
    text can fake one. A terminal event is the stream's last, so each chunk is judged by
    its last line of that field (`data:` / `event:`), found from the chunk's end: that
    costs the chunk's last event, not the chunk (Responses' response.completed carries
    the whole response, so its event line can lie far from the end of the stream). The
    few bytes before a chunk boundary are kept, so a line split across two chunks is
    still seen; nothing else of the stream is held. All `ends` are lines of one field.
    A compressed stream (`encoding`: its Content-Encoding) is judged by what it
    inflates to, piece by bounded piece; one in an encoding not read is never ended."""

    __slots__ = ("_ends", "_field", "_inflate", "_keep", "_tail")

    def __init__(self, ends: tuple[bytes, ...], encoding: str | None = None) -> None:
        self._ends = tuple(b"\n" + e for e in ends)
        first = self._ends[0]
        self._field = first[: first.index(b": ") + 2]  # b"\ndata: ", b"\nevent: "
        self._keep = max(map(len, self._ends)) - 1
        self._tail = b"\n"  # the stream's first line starts a line too
        self._inflate = Inflate.for_encoding(encoding)

    def seen(self, chunk: bytes) -> bool:
        """Is the last line of the field in `chunk` (or one across the boundary before
        it) a terminal event line?"""
        if self._inflate is None:
            return self._seen(chunk)
        try:  # the terminal event is the stream's last: what follows it is not needed
            return any(self._seen(piece) for piece in self._inflate.feed(chunk))
        except (TooBig, zlib.error):
            self._inflate = Unreadable(0)  # a corrupt stream: never ended from now on
            return False

    def _seen(self, chunk: bytes) -> bool:
        keep, field, ends = self._keep, self._field, self._ends
        edge = self._tail + chunk[:keep]
        self._tail = edge[-keep:] if len(chunk) < keep else chunk[-keep:]
        last = edge.rfind(field)
        if last >= 0 and edge.startswith(ends, last):
            return True
        last = chunk.rfind(field)
        return last >= 0 and chunk.startswith(ends, last)


MAX_HEADER_BYTES = 64 << 10  # one response header line or field from an upstream
MAX_HEADERS = 1024  # response headers from an upstream


class UpstreamPool:
    """One keep-alive ClientSession per upstream origin, closed at shutdown."""

    def __init__(self) -> None:
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def session(self, up: Upstream) -> aiohttp.ClientSession:
        s = self._sessions.get(up.base_url)
        if s is None or s.closed:
            s = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300),
                auto_decompress=False,
                # no per-request proxy/netrc lookup (aiohttp does it in a thread);
                # an egress proxy is configured per upstream instead
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                # an answer the client's own SDK reads (aiohttp's 8 KiB header field and
                # 128 headers would make it a 502): bounded, generously
                max_line_size=MAX_HEADER_BYTES, max_field_size=MAX_HEADER_BYTES,
                max_headers=MAX_HEADERS,
            )
            self._sessions[up.base_url] = s
        return s

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            await s.close()


def has_dot_segment(path: str) -> bool:
    """Does this (percent-decoded) path hold a `.` or `..` segment, `\\` counting as `/`?
    Such a path could climb out of an upstream's base URL or past a route's glob once
    something on the way normalises it, so it is refused before routing."""
    if "." not in path:
        return False
    return any(seg in (".", "..") for seg in path.replace("\\", "/").split("/"))


def injected_key(up: Upstream) -> str:
    """The gateway's own key for this upstream ("" when it relays the client's)."""
    return os.environ.get(up.api_key_env, "") if up.api_key_env else ""


def request_headers(incoming: Any, up: Upstream,
                    credential_headers: tuple[str, ...] = ()) -> CIMultiDict[str]:
    """What goes upstream: no hop-by-hop or gateway headers; with the gateway's own key,
    none of the client's credentials either (`credential_headers`: configured ones)."""
    out: CIMultiDict[str] = CIMultiDict()
    hop = hop_by_hop(incoming)
    for k, v in incoming.items():
        low = k.lower()
        if low not in hop and low not in GATEWAY_HEADERS:
            if not v.isascii() and _NOT_UTF8.search(v):
                # bytes that are not UTF-8 arrive as lone surrogates, which the client
                # would drop (`Bearer sk-\xe9t` sent as `Bearer sk-t`): refused, not changed
                raise BadRequest(f"header {k!r} holds bytes that are not UTF-8; the gateway "
                                 "cannot pass them on unchanged")
            out.add(k, v)
    if up.api_key_env:
        key = injected_key(up)
        if key:  # the gateway's key replaces whatever the client sent
            out.popall("Authorization", None)
            out.popall("x-api-key", None)
            out.popall("api-key", None)  # Azure OpenAI's
            for name in credential_headers:
                out.popall(name, None)
            if up.api_key_header in ("x-api-key", "api-key"):
                out[up.api_key_header] = key
            else:
                out["Authorization"] = f"Bearer {key}"
    return out


def _timeout(up: Upstream) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=None, sock_connect=up.connect_timeout_s, connect=up.connect_timeout_s,
        sock_read=up.read_timeout_s,
    )


def map_transport_error(exc: BaseException, up: Upstream) -> GatewayError:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamTimeout(
            f"upstream {up.name!r} did not answer in time "
            f"(connect {up.connect_timeout_s:g}s, read {up.read_timeout_s:g}s)"
        )
    return UpstreamUnreachable(f"upstream {up.name!r} is unreachable: {type(exc).__name__}")


async def relay(
    request: web.Request,
    pool: UpstreamPool,
    up: Upstream,
    body: bytes | AsyncIterator[bytes] | None,
    info: Relayed,
    extra_headers: dict[str, str] | None = None,
    credential_headers: tuple[str, ...] = (),
    stream_ends: tuple[bytes, ...] = (),
    original: bytes | None = None,
    usage_wire: str = "",
    on_sent: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Send the request upstream and stream the answer back as it arrives.

    `original`: the client's bytes, when `body` is the gateway's change of them; if the
    upstream refuses `body`, they are sent instead (once) and that answer is relayed.
    Raises GatewayError when no upstream response could be had; once the
    response has started, failures end the stream and are recorded in `info`.
    An event stream is complete once a `stream_ends` line was relayed, whoever
    hangs up after it. `usage_wire`: the wire whose `usage` the answer is read for
    (into `info.usage`, whatever part of it arrived). `on_sent`: called once the body
    is with the transport (or, when it never gets there, once the request failed).
    """
    headers = upstream_headers(request, up, credential_headers, extra_headers)
    t0 = time.perf_counter()
    up_resp = await send(request, pool, up, body, info, headers, original, on_sent)
    info.upstream_ms = (time.perf_counter() - t0) * 1000
    info.status = up_resp.status
    return await pass_on(request, up_resp, info, stream_ends, usage_wire)


def upstream_headers(request: web.Request, up: Upstream, credential_headers: tuple[str, ...],
                     extra_headers: dict[str, str] | None = None) -> CIMultiDict[str]:
    """The headers a request goes upstream with (`request_headers`, without the
    Content-Encoding of a body read_body decoded, with `extra_headers`)."""
    headers = request_headers(request.headers, up, credential_headers)
    if request.get(DECODED):  # read_body decoded the body that goes
        headers.popall("Content-Encoding", None)
    if extra_headers:
        headers.update(extra_headers)
    return headers


async def send(
    request: web.Request, pool: UpstreamPool, up: Upstream,
    body: bytes | AsyncIterator[bytes] | None, info: Relayed, headers: CIMultiDict[str],
    original: bytes | None = None, on_sent: Callable[[], None] | None = None,
) -> aiohttp.ClientResponse:
    """The upstream's response to `body` (its headers read; `original` resent once when
    it refuses a changed body). Raises GatewayError when there is none."""
    data = SentBody(body, on_sent) if isinstance(body, bytes) else body
    t0 = time.perf_counter()
    try:
        up_resp = await pool.session(up).request(
            request.method,
            target_url(up, request.path_qs),
            data=data,
            headers=headers,
            timeout=_timeout(up),
            allow_redirects=False,
            proxy=up.proxy,
        )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        info.upstream_ms = (time.perf_counter() - t0) * 1000
        raise map_transport_error(exc, up) from None
    finally:
        if isinstance(data, SentBody):
            data.sent()  # a no-op once written
        elif on_sent is not None:
            on_sent()
    if (original is not None and isinstance(body, bytes)
            and refuses(up_resp.status, up_resp.headers, body, original)):
        up_resp = await resend_original(pool, up, up_resp, headers, original, info)
    return up_resp


def answer_headers(up_resp: aiohttp.ClientResponse) -> web.StreamResponse:
    """The client's response to `up_resp`: its status, reason and end-to-end headers."""
    reason = up_resp.reason
    resp = web.StreamResponse(status=up_resp.status,
                              reason=as_written(reason) if reason else reason)
    hop = hop_by_hop(up_resp.headers)
    for k, v in up_resp.headers.items():
        if k.lower() not in hop:
            resp.headers.add(k, as_written(v))
    return resp


async def pass_on(request: web.Request, up_resp: aiohttp.ClientResponse, info: Relayed,
                  stream_ends: tuple[bytes, ...] = (), usage_wire: str = "",
                  ) -> web.StreamResponse:
    """Stream the upstream's answer to the client as it arrives (see `relay`)."""
    async with up_resp:
        resp = answer_headers(up_resp)
        if up_resp.content_length is not None:
            resp.content_length = up_resp.content_length
        try:
            await resp.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            info.client_left()
            return resp
        end = (StreamEnd(stream_ends, up_resp.headers.get("Content-Encoding"))
               if stream_ends and up_resp.content_type == "text/event-stream" else None)
        usage = reader_for(usage_wire, up_resp.status, up_resp.headers) if usage_wire else None
        try:
            async for chunk in up_resp.content.iter_any():
                info.bytes_out += len(chunk)
                await resp.write(chunk)
                if end is not None and end.seen(chunk):
                    info.ended, end = True, None
                if usage is not None:
                    usage.feed(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            info.client_left()
            return resp
        except (TimeoutError, aiohttp.ClientError, OSError):
            # after its terminal event the answer is whole, however the upstream hangs up
            info.stream = "complete" if info.ended else "upstream_aborted"
            # the status line is gone already: a whole answer is ended cleanly; a cut one
            # is cut for the client too (the connection closed without the chunked end or
            # the rest of the Content-Length), so its SDK raises (and may retry) as it
            # would have talking to the upstream, never taking half an answer for all
            if info.ended:
                try:
                    await resp.write_eof()
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    pass
            elif request.transport is not None:
                request.transport.close()
            return resp
        finally:  # what arrived of the usage, however the answer ended
            if usage is not None:
                info.usage = usage.result()
                info.response_model, info.response_id = usage.model, usage.id
        try:
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            info.client_left()
    return resp


def refuses(status: int, headers: Mapping[str, str], sent: bytes, original: bytes) -> bool:
    """Did the upstream refuse the changed body `sent` itself, so that the client's
    `original` may be accepted? A 413 only when the original is not larger; an answer
    with a Retry-After is a condition of the upstream's (RFC 9110), relayed as it is."""
    if status not in REFUSALS or "Retry-After" in headers:
        return False
    return status != 413 or len(original) <= len(sent)


async def resend_original(
    pool: UpstreamPool, up: Upstream, refused: aiohttp.ClientResponse,
    headers: CIMultiDict[str], original: bytes, info: Relayed,
) -> aiohttp.ClientResponse:
    """Drop the refused answer (nothing of it was relayed) and send `original` to the
    same URL with the same headers; its answer is the one the client gets."""
    info.first_status = refused.status
    await _discard(refused)
    try:
        return await pool.session(up).request(
            refused.method, refused.url, data=original, headers=headers, timeout=_timeout(up),
            allow_redirects=False, proxy=up.proxy,
        )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise map_transport_error(exc, up) from None


async def _discard(resp: aiohttp.ClientResponse) -> None:
    """Read a refused answer to its end (up to DISCARD_BYTES) so its connection is kept;
    a longer or broken one is closed."""
    got = 0
    try:
        while got <= DISCARD_BYTES:
            chunk = await resp.content.readany()
            if not chunk:
                resp.release()
                return
            got += len(chunk)
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    resp.close()


MAX_WS_MESSAGE = 16 << 20  # one WebSocket message either way (Realtime audio is far less)


def is_websocket(request: web.Request) -> bool:
    """An upgrade to a WebSocket (the OpenAI Realtime API's connect())."""
    return (request.method == "GET"
            and request.headers.get("Upgrade", "").lower() == "websocket"
            and "upgrade" in request.headers.get("Connection", "").lower())


async def relay_websocket(request: web.Request, pool: UpstreamPool, up: Upstream,
                          info: Relayed, credential_headers: tuple[str, ...] = ()
                          ) -> web.StreamResponse:
    """A WebSocket relayed: the upgrade passed on to the upstream (the client's headers
    and subprotocols, as for any request), then every message both ways as it comes,
    until either side closes, with its close code. A refused upgrade is relayed as the
    upstream's status; raises GatewayError when the upstream cannot be reached."""
    headers = request_headers(request.headers, up, credential_headers)
    for name in [k for k in headers if k.lower().startswith("sec-websocket-")]:
        headers.popall(name, None)
    protocols = tuple(p.strip() for v in request.headers.getall("Sec-WebSocket-Protocol", ())
                      for p in v.split(",") if p.strip())
    t0 = time.perf_counter()
    try:
        upstream = await pool.session(up).ws_connect(
            target_url(up, request.path_qs), headers=headers, protocols=protocols,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=10.0),
            proxy=up.proxy, max_msg_size=MAX_WS_MESSAGE, autoping=True)
    except aiohttp.WSServerHandshakeError as exc:  # the upstream answered, not with 101
        info.status = exc.status
        return web.Response(status=exc.status, text=exc.message or "",
                            headers={k: v for k, v in (exc.headers or {}).items()
                                     if k.lower() not in hop_by_hop(exc.headers or {})
                                     and k.lower() != "content-length"})
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise map_transport_error(exc, up) from None
    info.upstream_ms = (time.perf_counter() - t0) * 1000
    info.status = 101
    client = web.WebSocketResponse(
        protocols=(upstream.protocol,) if upstream.protocol else (),
        max_msg_size=MAX_WS_MESSAGE, autoping=True)
    both: list[asyncio.Future[None]] = []
    try:
        await client.prepare(request)

        async def pump(src: Any, dst: Any) -> None:
            async for msg in src:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    info.bytes_out += len(msg.data)
                    await dst.send_str(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    info.bytes_out += len(msg.data)
                    await dst.send_bytes(msg.data)
            await dst.close(code=src.close_code or aiohttp.WSCloseCode.OK)

        both += [asyncio.ensure_future(pump(upstream, client)),
                 asyncio.ensure_future(pump(client, upstream))]
        done, pending = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:  # the other side is closed by then: its pump ends too
            try:
                await asyncio.wait_for(task, 10)
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                task.cancel()
        for task in done:
            failed = task.exception()
            if failed is not None and not isinstance(failed,
                                                     aiohttp.ClientError | ConnectionError):
                raise failed
    finally:  # the client gone (the handler cancelled): neither pump outlives it
        for task in both:
            task.cancel()
        await upstream.close()
    return client
