"""Forwarding: header hygiene, one pooled session per upstream, streaming relay.

Transport exceptions are mapped to gateway errors here and nowhere else.
The upstream is chosen by config only; nothing the client sends (URL, Host,
headers) can point the gateway anywhere else.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .errors import GatewayError, UpstreamTimeout, UpstreamUnreachable
from .rules import Upstream

HOP_BY_HOP = frozenset(
    (
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
    )
)
# the gateway's own request headers: consumed here, never sent upstream
GATEWAY_HEADERS = frozenset(("x-memgate-admin-token",))


@dataclass(slots=True)
class Relayed:
    """What happened on the wire, for the [mem] line and metrics."""

    status: int = 0
    upstream_ms: float = 0.0
    bytes_out: int = 0
    stream: str = "complete"  # complete | upstream_aborted | client_gone


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


def target_url(up: Upstream, path_qs: str) -> str:
    """base_url + the client's path; a base ending in /v1 does not double it."""
    base = up.base_url
    if urlsplit(base).path.endswith("/v1") and (path_qs == "/v1" or path_qs.startswith("/v1/")
                                                  or path_qs.startswith("/v1?")):
        base = base[: -len("/v1")]
    return base + path_qs


def request_headers(incoming: Any, up: Upstream) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for k, v in incoming.items():
        low = k.lower()
        if low not in HOP_BY_HOP and low not in GATEWAY_HEADERS:
            out.add(k, v)
    if up.api_key_env:
        key = os.environ.get(up.api_key_env, "")
        if key:  # the gateway's key replaces whatever the client sent
            out.popall("Authorization", None)
            out.popall("x-api-key", None)
            if up.api_key_header == "x-api-key":
                out["x-api-key"] = key
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
) -> web.StreamResponse:
    """Send the request upstream and stream the answer back as it arrives.

    Raises GatewayError when no upstream response could be had; once the
    response has started, failures end the stream and are recorded in `info`.
    """
    headers = request_headers(request.headers, up)
    if extra_headers:
        headers.update(extra_headers)
    t0 = time.perf_counter()
    try:
        up_resp = await pool.session(up).request(
            request.method,
            target_url(up, request.path_qs),
            data=body,
            headers=headers,
            timeout=_timeout(up),
            allow_redirects=False,
            proxy=up.proxy,
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        info.upstream_ms = (time.perf_counter() - t0) * 1000
        raise map_transport_error(exc, up) from None
    info.upstream_ms = (time.perf_counter() - t0) * 1000
    info.status = up_resp.status
    async with up_resp:
        resp = web.StreamResponse(status=up_resp.status, reason=up_resp.reason)
        for k, v in up_resp.headers.items():
            if k.lower() not in HOP_BY_HOP:
                resp.headers.add(k, v)
        if up_resp.content_length is not None:
            resp.content_length = up_resp.content_length
        try:
            await resp.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            info.stream = "client_gone"
            return resp
        try:
            async for chunk in up_resp.content.iter_any():
                info.bytes_out += len(chunk)
                await resp.write(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            info.stream = "client_gone"
            return resp
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            info.stream = "upstream_aborted"
            # the status line is gone already: end a chunked stream cleanly; a body
            # with a Content-Length cannot be completed, so the connection is closed
            if up_resp.content_length is None:
                try:
                    await resp.write_eof()
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    pass
            elif request.transport is not None:
                request.transport.close()
            return resp
        try:
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            info.stream = "client_gone"
    return resp
