"""A deterministic OpenAI/Anthropic-compatible upstream for `memgate demo` (no network).

It answers from what it received, so a demo (or an A/B replay) shows what the
gateway forwarded: the reply names the message count, quotes the earlier
message that best matches the question (its "evidence": gone from the request,
gone from the answer) and lists the pinned facts it can still see. It records
every chat body it got, per session header.
"""

from __future__ import annotations

import re
import time
from typing import Any

import orjson
from aiohttp import web

RECORD = web.AppKey("records", list)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[\w./-]+", text.lower()) if len(w) > 3}


def _reply_text(body: dict[str, Any]) -> str:
    msgs = body.get("messages") or body.get("input") or []
    if isinstance(msgs, str):
        msgs = [{"role": "user", "content": msgs}]
    texts = [(m.get("role"), _text(m.get("content"))) for m in msgs if isinstance(m, dict)]
    pins = [t[:60] for _, t in texts if t.lstrip().startswith("[PIN]")]
    last_s = next((t for role, t in reversed(texts) if role == "user" and t), "")
    text = f"mock reply: I saw {len(msgs)} messages; you asked: {last_s[:60]!r}."
    asked = _words(last_s)
    best = max(
        ((len(asked & _words(t)), -i, t) for i, (_, t) in enumerate(texts[:-1]) if t),
        default=(0, 0, ""),
    )
    if best[0] >= 2:
        text += f" Evidence: {best[2][:200]}"
    if pins:
        text += " Pinned: " + " | ".join(pins)
    return text


async def _received(request: web.Request) -> dict[str, Any]:
    """The request body, recorded per session header for the demo's table."""
    raw = await request.read()
    body: dict[str, Any] = orjson.loads(raw)
    request.app[RECORD].append(
        {"session": request.headers.get("X-Session-Id"), "body": body, "bytes": len(raw)}
    )
    return body


async def chat(request: web.Request) -> web.StreamResponse:
    body = await _received(request)
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


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages, plain or streamed."""
    body = await _received(request)
    text = _reply_text(body)
    message = {"id": "msg_mock", "type": "message", "role": "assistant",
               "model": body.get("model", "mock"), "content": [{"type": "text", "text": text}],
               "stop_reason": "end_turn", "stop_sequence": None,
               "usage": {"input_tokens": 0, "output_tokens": 0}}
    if not body.get("stream"):
        return web.Response(body=orjson.dumps(message), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def event(name: str, data: dict[str, Any]) -> None:
        await resp.write(f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n")

    await event("message_start", {"type": "message_start",
                                  "message": {**message, "content": [], "stop_reason": None}})
    await event("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}})
    await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}})
    await event("content_block_stop", {"type": "content_block_stop", "index": 0})
    await event("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": 0}})
    await event("message_stop", {"type": "message_stop"})
    await resp.write_eof()
    return resp


async def responses(request: web.Request) -> web.Response:
    """OpenAI Responses, plain."""
    body = await _received(request)
    text = _reply_text(body)
    return web.Response(body=orjson.dumps({
        "id": "resp_mock", "object": "response", "created_at": int(time.time()),
        "status": "completed", "model": body.get("model", "mock"),
        "output": [{"type": "message", "id": "msg_mock", "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
    }), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "owned_by": "mock"}]}
    )


def create_mock_app() -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[RECORD] = []
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    return app
