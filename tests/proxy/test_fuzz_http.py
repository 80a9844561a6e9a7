"""Fuzz over real HTTP: memgate answers every request, good or bad, without a 5xx of its
own, every error it makes is in the shape of the API the client speaks, and the client's
keep-alive connection is still usable after the answer.

The gateway and a recording upstream run on real sockets in a background thread (one pair
for the module); each example opens a plain `http.client` connection, sends its request and
then asks `/healthz` on the same connection.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.rules import load_rules
from gateway.proxy.app import create_app
from tests.conftest import ANTHROPIC_REPLY, CHAT_REPLY, ROOT, SECRET, responses_object

pytestmark = pytest.mark.slow

ROUTES = {
    "/v1/chat/completions": "openai",
    "/v1/responses": "openai",
    "/v1/messages": "anthropic",
    "/v1/memories": "openai",
    "/v1/memories/search": "openai",
}


class Servers:
    """A recording upstream and a gateway in front of it, on their own event loop."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.gateway_port = 0
        self.received = 0
        self.runners: list[web.AppRunner] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _upstream(self, request: web.Request) -> web.Response:
        await request.read()
        self.received += 1
        body = {"/v1/messages": ANTHROPIC_REPLY,
                "/v1/responses": responses_object("ok")}.get(request.path, CHAT_REPLY)
        return web.Response(body=orjson.dumps(body), content_type="application/json",
                            headers={"X-Upstream": "yes"})

    async def _start(self) -> None:
        up = web.Application(client_max_size=1 << 26)
        up.router.add_route("*", "/{tail:.*}", self._upstream)
        up_runner = web.AppRunner(up)
        await up_runner.setup()
        site = web.TCPSite(up_runner, "127.0.0.1", 0)
        await site.start()
        up_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{up_port}"
        cfg = self.tmp / "gateway.yaml"
        cfg.write_text(yaml.safe_dump({
            "memory": {"enable_eviction": True, "shadow": True,
                       "budget": {"max_tokens": 300, "max_chars": 2000, "max_messages": 8,
                                  "max_turns": 3}},
            "tokens": {"models_file": str(ROOT / "rules" / "models.yaml")},
            "limits": {"max_body_bytes": 65536},
            "store": {"backend": "sqlite", "path": str(self.tmp / "mem.db"),
                      "archive": "evicted", "recall": {"enabled": True, "top_k": 2}},
        }), encoding="utf-8")
        env = {"MEMGATE_UPSTREAM": url, "MEMGATE_ANTHROPIC_UPSTREAM": url}
        app = create_app(load_rules(cfg, env), cfg, env, watch_interval_s=60)
        gw_runner = web.AppRunner(app)
        await gw_runner.setup()
        gw_site = web.TCPSite(gw_runner, "127.0.0.1", 0)
        await gw_site.start()
        self.gateway_port = gw_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.runners = [gw_runner, up_runner]

    async def _stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()

    def start(self) -> None:
        self.thread.start()
        assert self.ready.wait(30), "servers did not start"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("fuzz"))
    s.start()
    yield s
    s.stop()


class Client:
    """One keep-alive connection; requests are written as given (no header normalising)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)

    def send(self, method: str, path: str, body: bytes, headers: dict[str, bytes | str]
             ) -> tuple[int, http.client.HTTPMessage, bytes]:
        self.conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers.items():
            self.conn.putheader(k, v)
        self.conn.putheader("Content-Length", str(len(body)))
        self.conn.endheaders(body)
        resp = self.conn.getresponse()
        return resp.status, resp.headers, resp.read()


def error_shape_ok(flavor: str, data: bytes) -> bool:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    err = body["error"]
    if flavor == "anthropic":
        return body.get("type") == "error" and isinstance(err.get("message"), str) \
            and isinstance(err.get("type"), str)
    return isinstance(err.get("message"), str) and bool(err["message"])


json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
keys = st.sampled_from(["role", "content", "messages", "input", "system", "tool_calls",
                        "tool_call_id", "type", "text", "memgate", "pin", "score", "ttl",
                        "call_id", "id", "name", "model", "stream", "max_tokens", "source",
                        "image_url", "url", "output", "tool_use_id", "session_id", "turn_id",
                        "ts", "tags", "memory_type", "query", "user_text", "records"])
json_values = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner,
                                                                           max_size=5),
    max_leaves=25)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", 7, None,
                         {"x": 1}])
message = st.fixed_dictionaries(
    {"role": roles, "content": st.text(max_size=40) | json_values},
    optional={"memgate": json_values, "tool_call_id": st.text(max_size=5),
              "tool_calls": json_values, "type": st.sampled_from(
                  ["message", "function_call", "function_call_output", "item_reference"]),
              "call_id": st.text(max_size=5)})
chat_like = st.fixed_dictionaries(
    {"model": st.sampled_from(["gpt-4o-mini", "claude-3-5-haiku-20241022", 5]),
     "messages": st.lists(message, max_size=8)},
    optional={"input": st.lists(message, max_size=6) | st.text(max_size=20),
              "system": st.text(max_size=20) | json_values, "stream": st.just(False),
              "max_tokens": st.integers(-5, 10_000) | json_leaf})


def dumps(value: Any) -> bytes:
    """JSON text as a client writes it (the standard library keeps integers of any size)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


bodies = (
    chat_like.map(dumps)
    | json_values.map(dumps)
    | st.binary(max_size=200)
    | st.tuples(chat_like.map(dumps), st.integers(0, 400)).map(lambda t: t[0][: t[1]])
)
auth = st.sampled_from([
    {"Authorization": f"Bearer {SECRET}"}, {"x-api-key": SECRET}, {"api-key": SECRET},
    {"Authorization": "Bearer "}, {"Authorization": b"Bearer \xff\xfe"}, {},
])
encodings = st.sampled_from(["", "", "", "gzip", "gzip-broken", "br", "deflate-broken"])


def encode(body: bytes, how: str) -> tuple[bytes, dict[str, str]]:
    if how == "gzip":
        return gzip.compress(body), {"Content-Encoding": "gzip"}
    if how == "gzip-broken":
        return b"\x1f\x8b\x08\x00garbage" + body[:20], {"Content-Encoding": "gzip"}
    if how == "deflate-broken":
        return body[:30], {"Content-Encoding": "deflate"}
    if how == "br":
        return body, {"Content-Encoding": "br"}
    return body, {}


@settings(max_examples=250)
@given(route=st.sampled_from(sorted(ROUTES)), body=bodies, creds=auth, how=encodings)
def test_no_gateway_5xx_shaped_errors_connection_kept(
    servers: Servers, route: str, body: bytes, creds: dict[str, Any], how: str
) -> None:
    """Any body, credential and encoding: an upstream answer or a shaped 4xx; the same
    keep-alive connection then still answers /healthz."""
    client = Client(servers.gateway_port)
    try:
        data, enc = encode(body, how)
        headers = {"Content-Type": "application/json", **enc, **creds}
        status, resp_headers, answer = client.send("POST", route, data, headers)
        from_upstream = resp_headers.get("X-Upstream") == "yes"
        assert from_upstream or status < 500, (status, answer[:300])
        if not from_upstream and status >= 400:
            assert error_shape_ok(ROUTES[route], answer), (status, answer[:300])
        assert SECRET.encode() not in answer
        status2, _, answer2 = client.send("GET", "/healthz", b"", {})
        assert status2 == 200, answer2[:200]
    finally:
        client.conn.close()


@settings(max_examples=60)
@given(memory_id=st.text(max_size=40), creds=auth)
def test_memory_reads_never_5xx(servers: Servers, memory_id: str, creds: dict[str, Any]) -> None:
    """GET/DELETE of any id, with any credential: a JSON answer, never a gateway 5xx."""
    from urllib.parse import quote

    client = Client(servers.gateway_port)
    try:
        for method in ("GET", "DELETE"):
            status, _, answer = client.send(method, "/v1/memories/" + quote(memory_id, safe=""),
                                            b"", dict(creds))
            assert status < 500, (status, answer[:300])
            if status >= 400:
                assert error_shape_ok("openai", answer), (status, answer[:300])
    finally:
        client.conn.close()
