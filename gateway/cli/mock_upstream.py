"""A deterministic OpenAI/Anthropic-compatible upstream for `memgate demo` (no network).

It answers from what it received, so a demo (or an A/B replay) shows what the
gateway forwarded: the reply names the message count, quotes the earlier
message that best matches the question (its "evidence": gone from the request,
gone from the answer) and lists the pinned facts it can still see. It records
every chat body it got, per session header.
"""

from __future__ import annotations

import re
import sys
import time
from collections import OrderedDict
from typing import Any

import orjson
from aiohttp import web

RECORD = web.AppKey("records", list)
PROMPTS = web.AppKey("prompts", OrderedDict)
# a provider's prompt cache, as OpenAI documents it: a prefix of 1024 tokens or more is
# read from the cache in steps of 128; the mock remembers this many sessions' prompts
CACHE_MIN_TOKENS = 1024
CACHE_STEP = 128
CACHE_SESSIONS = 256


def _tokens(raw: bytes) -> int:
    """A provider-like count: about four bytes of JSON per token."""
    return max(1, len(raw) // 4)


def _prompt_usage(request: web.Request, body: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt tokens, of them cached, of them at or before the last cache_control) for
    this request; the cached part is the prefix it shares with the session's last one.
    The prompt is its model-visible parts in order: system / instructions / tools, then
    the items."""
    items = body.get("messages") or body.get("input") or []
    if isinstance(items, str):
        items = [items]
    head = {k: body[k] for k in ("system", "instructions", "tools") if k in body}
    parts = [orjson.dumps(head)] + [orjson.dumps(m) for m in items]
    sizes = [_tokens(p) for p in parts]
    cache: OrderedDict[str, list[bytes]] = request.app[PROMPTS]
    key = request.headers.get("X-Session-Id", "")
    prev = cache.pop(key, [])
    cache[key] = parts
    while len(cache) > CACHE_SESSIONS:
        cache.popitem(last=False)
    same = 0
    for a, b in zip(parts, prev, strict=False):
        if a != b:
            break
        same += 1
    shared = sum(sizes[:same])
    cached = shared // CACHE_STEP * CACHE_STEP if shared >= CACHE_MIN_TOKENS else 0
    marked = max((i for i, p in enumerate(parts) if b'"cache_control"' in p), default=-1)
    return sum(sizes), cached, sum(sizes[: marked + 1])


def _output_tokens(text: str) -> int:
    return max(1, len(text.encode()) // 4)


def chat_usage(request: web.Request, body: dict[str, Any], text: str) -> dict[str, Any]:
    total, cached, _ = _prompt_usage(request, body)
    out = _output_tokens(text)
    return {"prompt_tokens": total, "completion_tokens": out, "total_tokens": total + out,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


def responses_usage(request: web.Request, body: dict[str, Any], text: str) -> dict[str, Any]:
    total, cached, _ = _prompt_usage(request, body)
    out = _output_tokens(text)
    return {"input_tokens": total, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total + out}


def anthropic_usage(request: web.Request, body: dict[str, Any]) -> dict[str, int]:
    """Anthropic caches only up to a cache_control breakpoint, and its input_tokens
    counts what is neither read from nor written to the cache."""
    total, cached, upto_marker = _prompt_usage(request, body)
    read = min(cached, upto_marker)
    write = max(0, upto_marker - read) if upto_marker else 0
    return {"input_tokens": total - read - write, "cache_creation_input_tokens": write,
            "cache_read_input_tokens": read}


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
    usage = chat_usage(request, body, text)
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
                "usage": usage,
            },
            dumps=lambda o: orjson.dumps(o).decode(),
        )
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    opts = body.get("stream_options")
    # with include_usage every chunk says "usage": null and one more, with no choices, has it
    nulls = {"usage": None} if isinstance(opts, dict) and opts.get("include_usage") else {}
    words = text.split(" ")
    for i, w in enumerate(words):
        chunk = {
            "id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": created,
            "model": body.get("model", "mock"),
            "choices": [{"index": 0, "delta": {"content": w + (" " if i < len(words) - 1 else "")},
                         "finish_reason": None}], **nulls,
        }
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    done = {"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": created,
            "model": body.get("model", "mock"),
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    if nulls:
        await resp.write(b"data: " + orjson.dumps({**done, **nulls}) + b"\n\n")
        done = {**done, "choices": [], "usage": usage}
    await resp.write(b"data: " + orjson.dumps(done) + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages, plain or streamed."""
    body = await _received(request)
    text = _reply_text(body)
    usage = anthropic_usage(request, body)
    out = _output_tokens(text)
    message = {"id": "msg_mock", "type": "message", "role": "assistant",
               "model": body.get("model", "mock"), "content": [{"type": "text", "text": text}],
               "stop_reason": "end_turn", "stop_sequence": None,
               "usage": {**usage, "output_tokens": out}}
    if not body.get("stream"):
        return web.Response(body=orjson.dumps(message), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def event(name: str, data: dict[str, Any]) -> None:
        await resp.write(f"event: {name}\ndata: ".encode() + orjson.dumps(data) + b"\n\n")

    await event("message_start", {"type": "message_start",
                                  "message": {**message, "content": [], "stop_reason": None,
                                              "usage": {**usage, "output_tokens": 1}}})
    await event("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}})
    await event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}})
    await event("content_block_stop", {"type": "content_block_stop", "index": 0})
    await event("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": out}})
    await event("message_stop", {"type": "message_stop"})
    await resp.write_eof()
    return resp


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI Responses, plain or streamed (created, text deltas, completed)."""
    body = await _received(request)
    text = _reply_text(body)
    done = {
        "id": "resp_mock", "object": "response", "created_at": int(time.time()),
        "status": "completed", "model": body.get("model", "mock"),
        "output": [{"type": "message", "id": "msg_mock", "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "usage": responses_usage(request, body, text),
    }
    if not body.get("stream"):
        return web.Response(body=orjson.dumps(done), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    seq = 0

    async def event(name: str, data: dict[str, Any]) -> None:
        nonlocal seq
        await resp.write(f"event: {name}\ndata: ".encode()
                         + orjson.dumps({"type": name, "sequence_number": seq, **data})
                         + b"\n\n")
        seq += 1

    item = done["output"][0]
    part = {"type": "output_text", "text": "", "annotations": []}
    at = {"item_id": "msg_mock", "output_index": 0, "content_index": 0}
    started = {**done, "status": "in_progress", "output": [], "usage": None}
    await event("response.created", {"response": started})
    await event("response.in_progress", {"response": started})
    await event("response.output_item.added", {"output_index": 0, "item": {
        **item, "status": "in_progress", "content": []}})
    await event("response.content_part.added", {**at, "part": part})
    words = text.split(" ")
    for i, word in enumerate(words):
        await event("response.output_text.delta",
                    {**at, "delta": word + (" " if i < len(words) - 1 else ""), "logprobs": []})
    await event("response.output_text.done", {**at, "text": text, "logprobs": []})
    await event("response.content_part.done", {**at, "part": {**part, "text": text}})
    await event("response.output_item.done", {"output_index": 0, "item": item})
    await event("response.completed", {"response": done})
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": "gpt-4o-mini", "object": "model", "owned_by": "mock"}]}
    )


def create_mock_app() -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[RECORD] = []
    app[PROMPTS] = OrderedDict()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    # Azure OpenAI's routes: the same shapes under a deployment or its v1 API
    app.router.add_post("/openai/deployments/{deployment}/chat/completions", chat)
    app.router.add_post("/openai/v1/chat/completions", chat)
    app.router.add_post("/openai/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    return app


def main(argv: list[str] | None = None) -> int:
    """`python -m gateway.cli.mock_upstream`: the demo's upstream on its own, so the real SDKs
    can be pointed at a gateway in front of it without a provider key or the network."""
    import argparse
    import socket

    ap = argparse.ArgumentParser(
        prog="python -m gateway.cli.mock_upstream",
        description="A deterministic, offline OpenAI/Anthropic-compatible upstream (chat "
                    "completions, Responses, Messages, Azure routes; usage in every answer).")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    ap.add_argument("--port", type=int, default=9000,
                    help="port to listen on (9000; 0 = any free port)")
    args = ap.parse_args(argv)
    if not 0 <= args.port <= 65535:
        ap.error(f"--port {args.port}: must be 0-65535")
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"mock upstream: cannot listen on {args.host}:{args.port}: {exc.strerror}",
              file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    print(f"mock upstream listening on http://{host}:{port}", flush=True)
    web.run_app(create_mock_app(), sock=sock, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
