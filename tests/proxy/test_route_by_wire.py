"""Route by wire, through real HTTP: a request with Anthropic's headers reaches the
Anthropic upstream whatever its path; an OpenAI request still reaches the OpenAI one.

Two recording upstreams stand in for the providers, configured as the shipped list
(`anthropic`: `wire: anthropic`, paths `/v1/messages*` and `/`; `openai`: `wire: openai`,
`/*`); the real anthropic and openai SDKs are the callers.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import ANTHROPIC_REPLY, CHAT_REPLY, SECRET, GatewayFactory

MODEL = {"id": "m-1", "object": "model", "created": 0, "owned_by": "test", "type": "model",
         "display_name": "m-1", "created_at": "2025-01-01T00:00:00Z"}


@dataclass
class Provider:
    """A catch-all upstream that records every request and answers it in its API's shape."""

    server: TestServer
    received: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def paths(self) -> list[str]:
        return [f"{method} {path}" for method, path, _ in self.received]


async def provider(aiohttp_server: Any) -> Provider:
    rec = Provider(server=None)  # type: ignore[arg-type]

    async def anything(request: web.Request) -> web.StreamResponse:
        await request.read()
        rec.received.append((request.method, request.path_qs,
                             {k.lower(): v for k, v in request.headers.items()}))
        if request.method == "HEAD":
            return web.Response(status=200)
        if request.path.endswith("/v1/messages"):
            return web.Response(body=orjson.dumps(ANTHROPIC_REPLY),
                                content_type="application/json")
        if request.path.endswith("/chat/completions"):
            return web.Response(body=orjson.dumps(CHAT_REPLY), content_type="application/json")
        if request.path.endswith("/v1/models"):
            return web.json_response({"object": "list", "data": [MODEL], "has_more": False,
                                      "first_id": "m-1", "last_id": "m-1"})
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    rec.server = await aiohttp_server(app)
    return rec


def dead_url() -> str:
    """An address nothing listens on: the OpenAI upstream unreachable, as in the issue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_the_anthropic_sdk_with_a_path_prefix_reaches_the_anthropic_upstream(
    gateway: GatewayFactory, aiohttp_server: Any,
) -> None:
    """A base URL of the gateway plus a prefix: paths no upstream of Anthropic's wire
    claims (the prefix puts them off /v1/messages*) still go to it, not to the OpenAI
    catch-all (unreachable here: a 502 before)."""
    claude = await provider(aiohttp_server)
    gw = await gateway(upstream_url=dead_url(),
                       env={"MEMGATE_ANTHROPIC_UPSTREAM": claude.url})
    async with anthropic.AsyncAnthropic(base_url=f"{gw.url}/team-a", api_key=SECRET,
                                        max_retries=0) as c:
        msg = await c.messages.create(model="claude-sonnet-4-5", max_tokens=16,
                                      messages=[{"role": "user", "content": "hi"}])
        models = await c.models.list()
    assert msg.content[0].text == "Hello from Claude"  # type: ignore[union-attr]
    assert [m.id for m in models.data] == ["m-1"]
    assert claude.paths == ["POST /team-a/v1/messages", "GET /team-a/v1/models"]
    # (this SDK sends its key as `Authorization: Bearer`: anthropic-version tells it)
    assert all(h["authorization"] == f"Bearer {SECRET}" and h["anthropic-version"]
               for _, _, h in claude.received)


async def test_head_root_goes_to_the_anthropic_upstream(
    gateway: GatewayFactory, aiohttp_server: Any,
) -> None:
    """`HEAD /` with anthropic-version, and Claude Code's start-up `HEAD /` as it really
    comes (Bun's preconnect: no Anthropic header; the shipped path "/" claims it): both
    answered by the Anthropic upstream, though the OpenAI one is unreachable."""
    claude = await provider(aiohttp_server)
    gw = await gateway(upstream_url=dead_url(),
                       env={"MEMGATE_ANTHROPIC_UPSTREAM": claude.url})
    async with aiohttp.ClientSession() as http:
        async with http.head(f"{gw.url}/", headers={"anthropic-version": "2023-06-01",
                                                    "x-api-key": SECRET}) as r:
            assert r.status == 200
        async with http.head(f"{gw.url}/", headers={"User-Agent": "Bun/1.4.0",
                                                    "Accept": "*/*"}) as r:
            assert r.status == 200
    assert claude.paths == ["HEAD /", "HEAD /"]


async def test_requests_without_anthropic_headers_still_go_to_the_openai_upstream(
    gateway: GatewayFactory, aiohttp_server: Any,
) -> None:
    """The OpenAI SDK (Authorization) reaches the OpenAI upstream on every path; an
    x-api-key alone is Anthropic's, beside Authorization it is not; a Host header
    naming another address changes nothing (only the config chooses)."""
    gpt, claude = await provider(aiohttp_server), await provider(aiohttp_server)
    gw = await gateway(upstream_url=gpt.url, env={"MEMGATE_ANTHROPIC_UPSTREAM": claude.url})
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        reply = await c.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        models = await c.models.list()
    assert reply.choices[0].message.content == "hello from upstream"
    assert [m.id for m in models.data] == ["m-1"]
    async with aiohttp.ClientSession() as http:
        for headers in ({"x-api-key": SECRET, "Authorization": f"Bearer {SECRET}"},
                        {"x-api-key": SECRET},
                        {"Authorization": f"Bearer {SECRET}", "Host": "evil.example:443"},
                        {"anthropic-version": "2023-06-01", "Host": "evil.example"}):
            async with http.get(f"{gw.url}/v1/files", headers=headers) as r:
                assert r.status == 200
    assert gpt.paths == ["POST /v1/chat/completions", "GET /v1/models", "GET /v1/files",
                         "GET /v1/files"]
    assert claude.paths == ["GET /v1/files", "GET /v1/files"]
    assert "x-api-key" in claude.received[0][2] and "authorization" not in claude.received[0][2]
