"""Shared fixtures: a recording upstream, a gateway in front of it, captured logs."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings

from gateway.config.rules import load_rules
from gateway.observe import logging as mglog
from gateway.proxy.app import create_app
from gateway.proxy.appstate import STATE

# CI runs a fixed, reproducible set of examples; HYPOTHESIS_PROFILE=thorough explores.
settings.register_profile(
    "default", max_examples=150, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", max_examples=3000, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ROOT = Path(__file__).resolve().parent.parent
PG_DSN = os.environ.get("MEMGATE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SAMPLES = ROOT / "samples"
SECRET = "sk-test-SECRET-0123456789abcdef"


@contextlib.asynccontextmanager
async def pg_schema() -> AsyncIterator[tuple[str, Any]]:
    """A throwaway PostgreSQL schema and a connection to inspect it; dropped afterwards."""
    import asyncpg

    schema = f"memgate_t_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(PG_DSN)
    await conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema, conn
    finally:
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
        await conn.close()


def sample(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SAMPLES / f"{name}.json").read_text(encoding="utf-8"))
    return data


@dataclass
class Upstream:
    """An aiohttp test server standing in for OpenAI; it records what it received."""

    server: TestServer
    received: list[dict[str, Any]] = field(default_factory=list)
    # a body containing one of these bytes is answered only once its event is set
    holds: dict[bytes, asyncio.Event] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def last_body(self) -> dict[str, Any]:
        body: dict[str, Any] = orjson.loads(self.received[-1]["raw"])
        return body


CHAT_REPLY = {
    "id": "chatcmpl-test",
    "object": "chat.completion",
    "created": 1730000000,
    "model": "gpt-4o-mini",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "hello from upstream"}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
}


def sse_chunks(words: list[str]) -> list[bytes]:
    out = []
    for w in words:
        chunk = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1730000000,
                 "model": "gpt-4o-mini",
                 "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    end = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1730000000,
           "model": "gpt-4o-mini", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    out.append(b"data: " + orjson.dumps(end) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


ANTHROPIC_REPLY = {
    "id": "msg_test", "type": "message", "role": "assistant", "model": "claude-3-5-haiku-20241022",
    "content": [{"type": "text", "text": "Hello from Claude"}],
    "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 10, "output_tokens": 4},
}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: ".encode() + orjson.dumps(data) + b"\n\n"


def anthropic_events(text: str) -> list[bytes]:
    start = {**ANTHROPIC_REPLY, "content": [], "stop_reason": None,
             "usage": {"input_tokens": 10, "output_tokens": 0}}
    out = [sse("message_start", {"type": "message_start", "message": start}),
           sse("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "text", "text": ""}})]
    for word in text.split(" "):
        out.append(sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta",
                                                         "text": word + " "}}))
    out += [sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": 4}}),
            sse("message_stop", {"type": "message_stop"})]
    return out


def responses_object(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": "resp_test", "object": "response", "created_at": 1730000000, "status": status,
        "model": "gpt-4o-mini", "output": [{
            "type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        if status == "completed" else [],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def responses_events(text: str) -> list[bytes]:
    out = [sse("response.created", {"type": "response.created", "sequence_number": 0,
                                    "response": responses_object("", "in_progress")})]
    for n, word in enumerate(text.split(" "), start=1):
        out.append(sse("response.output_text.delta", {
            "type": "response.output_text.delta", "sequence_number": n, "item_id": "msg_1",
            "output_index": 0, "content_index": 0, "delta": word + " ", "logprobs": []}))
    out.append(sse("response.completed", {"type": "response.completed", "sequence_number": 99,
                                          "response": responses_object(text)}))
    return out


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def upstream(aiohttp_server: Any) -> Upstream:
    """Recording OpenAI-like upstream; tests may add routes via `extra_routes`."""
    rec = Upstream(server=None)  # type: ignore[arg-type]

    async def record(request: web.Request) -> bytes:
        raw = await request.read()
        rec.received.append({
            "method": request.method, "path": request.path_qs, "raw": raw,
            "headers": request.headers.copy(),
        })
        for tag, released in rec.holds.items():
            if tag in raw:
                await released.wait()
        return raw

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await record(request)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:  # bad-input tests: the gateway forwards what it got
            body = None
        if isinstance(body, dict) and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in sse_chunks(["Hel", "lo", " wor", "ld"]):
                await resp.write(chunk)
                await asyncio.sleep(0.01)
            await resp.write_eof()
            return resp
        return web.Response(body=orjson.dumps(CHAT_REPLY), content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        await record(request)
        return web.json_response({"object": "list", "data": [{"id": "gpt-4o-mini",
                                  "object": "model", "created": 0, "owned_by": "test"}]})

    async def echo(request: web.Request) -> web.Response:
        raw = await record(request)
        return web.Response(body=raw, status=201, headers={"X-Upstream": "yes"},
                            content_type="application/octet-stream")

    async def fail(request: web.Request) -> web.Response:
        await record(request)
        status = int(request.match_info["status"])
        return web.json_response({"error": {"message": f"upstream says {status}",
                                            "type": "upstream"}}, status=status)

    async def messages(request: web.Request) -> web.StreamResponse:
        raw = await record(request)
        body = orjson.loads(raw)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in anthropic_events("Hello from Claude"):
                await resp.write(event)
                await asyncio.sleep(0.005)
            await resp.write_eof()
            return resp
        return web.Response(body=orjson.dumps(ANTHROPIC_REPLY), content_type="application/json")

    async def responses(request: web.Request) -> web.StreamResponse:
        raw = await record(request)
        body = orjson.loads(raw)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in responses_events("Hello from responses"):
                await resp.write(event)
            await resp.write_eof()
            return resp
        return web.Response(body=orjson.dumps(responses_object("Hello from responses")),
                            content_type="application/json")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/v1/echo", echo)
    app.router.add_post("/status/{status}/v1/chat/completions", fail)
    rec.server = await aiohttp_server(app)
    return rec


def write_config(path: Path, memory: dict[str, Any] | None = None, **top: Any) -> Path:
    data: dict[str, Any] = {
        "memory": {"enable_eviction": False, "shadow": True,
                   "budget": {"max_tokens": 6000, "max_chars": 24000, "max_messages": 60,
                              "max_turns": 20}},
        "tokens": {"models_file": str(ROOT / "rules" / "models.yaml")},
    }
    if memory:
        for k, v in memory.items():
            if isinstance(v, dict):
                data["memory"].setdefault(k, {}).update(v)
            else:
                data["memory"][k] = v
    data.update(top)
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


@dataclass
class Gateway:
    server: TestServer
    app: web.Application
    config: Path
    log: io.StringIO

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def state(self) -> Any:
        return self.app[STATE]

    def mem_lines(self) -> list[str]:
        return [ln for ln in self.log.getvalue().splitlines() if ln.startswith("[mem] ")]

    async def wait_mem(self, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The [mem] events once there are n (the line follows the response: with a shared
        state backend it is written after an await, so a client can be faster)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(self.mem_lines()) < n and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert len(self.mem_lines()) >= n, f"expected {n} [mem] lines:\n{self.log.getvalue()}"
        return self.mem_events()

    def mem_events(self) -> list[dict[str, Any]]:
        """The [mem] lines parsed back into key -> value strings."""
        out = []
        for ln in self.mem_lines():
            fields = {}
            for part in ln[len("[mem] "):].split(" "):
                k, _, v = part.partition("=")
                fields[k] = v
            out.append(fields)
        return out


GatewayFactory = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def gateway(aiohttp_server: Any, upstream: Upstream, tmp_path: Path) -> GatewayFactory:
    """Factory: start a gateway (config written to tmp_path) in front of `upstream`."""

    async def start(
        memory: dict[str, Any] | None = None,
        upstream_url: str | None = None,
        env: dict[str, str] | None = None,
        fmt: str = "console",
        level: str = "info",
        watch_interval_s: float = 0.1,
        **top: Any,
    ) -> Gateway:
        cfg = write_config(tmp_path / "gateway.yaml", memory, **top)
        the_env = {"MEMGATE_UPSTREAM": upstream_url or upstream.url, **(env or {})}
        if "upstreams" not in top:  # the default config routes /v1/messages to "anthropic"
            the_env.setdefault("MEMGATE_ANTHROPIC_UPSTREAM", upstream_url or upstream.url)
        stream = io.StringIO()
        mglog.configure(fmt, level, stream=stream)
        rules = load_rules(cfg, the_env)
        app = create_app(rules, cfg, the_env, watch_interval_s=watch_interval_s)
        server = await aiohttp_server(app)
        return Gateway(server=server, app=app, config=cfg, log=stream)

    yield start  # type: ignore[misc]
    structlog.reset_defaults()
