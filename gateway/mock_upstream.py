"""A deterministic OpenAI-compatible upstream for `memgate demo` (no network).

It answers from what it received, so a demo (or a replay) shows what the
gateway forwarded: the reply names the message count and the pinned facts it
can still see. It records every chat body it got, per session header.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

RECORD = web.AppKey("records", list)


def _reply_text(body: dict[str, Any]) -> str:
    msgs = body.get("messages") or []
    pins = [
        m["content"][:60]
        for m in msgs
        if isinstance(m, dict) and isinstance(m.get("content"), str)
        and m["content"].lstrip().startswith("[PIN]")
    ]
    last = next(
        (m.get("content") for m in reversed(msgs) if isinstance(m, dict) and m.get("role") == "user"),
        "",
    )
    last_s = last if isinstance(last, str) else orjson.dumps(last).decode()
    text = f"mock reply: I saw {len(msgs)} messages; you asked: {last_s[:60]!r}."
    if pins:
        text += " Pinned: " + " | ".join(pins)
    return text


async def chat(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = orjson.loads(raw)
    request.app[RECORD].append(
        {"session": request.headers.get("X-Session-Id"), "body": body, "bytes": len(raw)}
    )
    text = _reply_text(body)
    created = int(time.time())
    if not body.get("stream"):
        return web.json_response(
            {
                "id": "chatcmpl-mock",
                "object": "chat.completion",
                "created": created,
                "model": body.get("model", "mock"),
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            },
            dumps=lambda o: orjson.dumps(o).decode(),
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    words = text.split(" ")
    for i, w in enumerate(words):
        chunk = {
            "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": created,
            "model": body.get("model", "mock"),
            "choices": [{"index": 0, "delta": {"content": w + (" " if i < len(words) - 1 else "")},
                         "finish_reason": None}],
        }
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    done = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": created,
            "model": body.get("model", "mock"),
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    await resp.write(b"data: " + orjson.dumps(done) + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "owned_by": "mock"}]}
    )


def create_mock_app() -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[RECORD] = []
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app
