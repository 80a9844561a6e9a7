"""Never a broken call: a body the gateway changed and the upstream refused is resent as
the client sent it, once, through real HTTP (and the openai SDK)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.proxy.upstream import refuses
from tests.conftest import CHAT_REPLY, SECRET, Gateway, GatewayFactory, sse_chunks

FULL = 10  # the client's history length: the picky upstream refuses anything shorter
EVICTING = {"enable_eviction": True, "budget": {"max_tokens": None, "max_chars": None,
                                                "max_messages": 4, "max_turns": None}}


@dataclass
class Picky:
    """An upstream that refuses any chat body with fewer than `refuse_below` messages
    (what an evicted body has), with `status` and `headers`; it records every body."""

    url: str = ""
    status: int = 400
    refuse_below: int = FULL
    headers: dict[str, str] = field(default_factory=dict)
    seen: list[bytes] = field(default_factory=list)


@pytest.fixture
async def picky(aiohttp_server: Any) -> Picky:
    p = Picky()

    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        p.seen.append(raw)
        body = orjson.loads(raw)
        if len(body["messages"]) < p.refuse_below:
            return web.json_response(
                {"error": {"message": "REFUSED: messages[1]: invalid tool_call_id",
                           "type": "invalid_request_error", "code": None}},
                status=p.status, headers=p.headers)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in sse_chunks(["Hel", "lo"]):
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        return web.Response(body=orjson.dumps(CHAT_REPLY), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await aiohttp_server(app)
    p.url = str(server.make_url("")).rstrip("/")
    return p


def history(stream: bool = False) -> bytes:
    """FULL messages, spelled as a client might (spaces, an escape, a big integer)."""
    msgs = []
    for t in range(FULL // 2):
        msgs.append(b'{"role": "user", "content": "question %d caf\\u00e9"}' % t)
        msgs.append(b'{"role": "assistant", "content": "answer %d"}' % t)
    tail = b', "stream": true' if stream else b""
    return (b'{"model": "gpt-4o-mini", "seed": 12345678901234567890, "messages": ['
            + b", ".join(msgs) + b"]" + tail + b"}")


async def post(gw: Gateway, body: bytes) -> tuple[int, bytes]:
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"}
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=body, headers=hdrs) as r:
        return r.status, await r.read()


async def metric(gw: Gateway, line_start: str) -> str | None:
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    found = [ln for ln in text.splitlines() if ln.startswith(line_start)]
    return found[0].rsplit(" ", 1)[1] if found else None


async def test_refused_evicted_body_is_resent_as_the_client_sent_it(
    gateway: GatewayFactory, picky: Picky
) -> None:
    """The evicted body is refused (400): the client's bytes go once more and the client
    gets the answer to them; [mem] and /metrics say so."""
    gw = await gateway(memory=EVICTING, upstream_url=picky.url)
    raw = history()
    status, body = await post(gw, raw)
    assert status == 200 and orjson.loads(body) == CHAT_REPLY
    assert len(picky.seen) == 2
    assert len(orjson.loads(picky.seen[0])["messages"]) < FULL  # the evicted one first
    assert picky.seen[1] == raw  # then the client's bytes, byte for byte
    ev = (await gw.wait_mem(1))[-1]
    assert ev["fallback"] == "original" and ev["first_status"] == "400"
    # the line says what went: the whole history, nothing dropped
    assert ev["status"] == "200" and ev["evict"] == "skipped"
    assert ev["reason"] == "upstream_refused" and (ev["kept"], ev["dropped"]) == (
        str(FULL), "0")
    assert "est_sent_tokens" not in ev and "cut" not in ev
    assert await metric(gw, 'memgate_fallback_total{route="openai_chat",status="400"}') == "1.0"
    before = await metric(gw, 'memgate_history_tokens_before_sum{route="openai_chat"}')
    assert before is not None
    assert await metric(gw, 'memgate_history_tokens_after_sum{route="openai_chat"}') == before


async def test_a_refused_session_goes_unchanged_until_the_backoff_ends(
    gateway: GatewayFactory, picky: Picky
) -> None:
    """After a refusal the session's next requests go as the client sent them, one
    upstream call each (no refused round trip first); once memory.fallback_backoff_s has
    passed eviction is tried again. Another session is not held back."""
    gw = await gateway(memory={**EVICTING, "fallback_backoff_s": 0.5}, upstream_url=picky.url)
    raw = history()
    for _ in range(2):
        assert (await post(gw, raw))[0] == 200
    assert [len(orjson.loads(b)["messages"]) for b in picky.seen] == [4, FULL, FULL]
    assert picky.seen[2] == raw
    ev = (await gw.wait_mem(2))[-1]
    assert "fallback" not in ev and ev["reason"] == "upstream_refused", ev
    other = raw.replace(b"question 0 ", b"question zero ")  # another session's history
    assert (await post(gw, other))[0] == 200
    assert len(picky.seen) == 5  # refused, then resent
    await asyncio.sleep(0.6)
    assert (await post(gw, raw))[0] == 200
    assert [len(orjson.loads(b)["messages"]) for b in picky.seen[5:]] == [4, FULL]
    evs = await gw.wait_mem(4)
    assert [e.get("fallback") for e in evs] == ["original", None, "original", "original"]


async def test_openai_sdk_gets_answers_to_its_original_stream_and_not(
    gateway: GatewayFactory, picky: Picky
) -> None:
    """The openai SDK as the caller, streamed and not: the refusal decides on the status
    line alone, not a byte of the refused answer reaches the client."""
    gw = await gateway(memory=EVICTING, upstream_url=picky.url)
    msgs = orjson.loads(history())["messages"]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        done = await c.chat.completions.create(model="gpt-4o-mini", messages=msgs)
        assert done.choices[0].message.content == "hello from upstream"
        resp = await c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", messages=msgs, stream=True)
        relayed = b""
        async for part in resp.http_response.aiter_bytes():
            relayed += part
    assert relayed == b"".join(sse_chunks(["Hel", "lo"]))
    assert b"REFUSED" not in relayed
    # the second request of the session goes unchanged: refused lately
    assert [len(orjson.loads(b)["messages"]) == FULL for b in picky.seen] == [
        False, True, True]
    evs = await gw.wait_mem(2)
    assert [(e.get("fallback"), e.get("first_status"), e["status"], e["reason"])
            for e in evs] == [("original", "400", "200", "upstream_refused"),
                              (None, None, "200", "upstream_refused")]


async def test_feature_off_relays_the_refusal(gateway: GatewayFactory, picky: Picky) -> None:
    """memory.fallback_original: false -> the client gets the upstream's 400, one body sent."""
    gw = await gateway(memory={**EVICTING, "fallback_original": False}, upstream_url=picky.url)
    status, body = await post(gw, history(stream=True))
    assert status == 400 and b"REFUSED" in body
    assert len(picky.seen) == 1
    ev = (await gw.wait_mem(1))[-1]
    assert "fallback" not in ev and ev["status"] == "400"


async def test_unchanged_body_refused_is_not_resent(
    gateway: GatewayFactory, picky: Picky
) -> None:
    """A body the gateway forwarded as it came is refused once: nothing to fall back to."""
    picky.refuse_below = 10_000
    gw = await gateway(memory={**EVICTING, "budget": {"max_messages": 100}},
                       upstream_url=picky.url)
    raw = history()
    status, body = await post(gw, raw)
    assert status == 400 and b"REFUSED" in body
    assert picky.seen == [raw]
    assert "fallback" not in (await gw.wait_mem(1))[-1]


async def test_original_refused_too_is_relayed_once(
    gateway: GatewayFactory, picky: Picky
) -> None:
    """The original is sent once, never more: its refusal is what the client gets."""
    picky.refuse_below = 10_000
    gw = await gateway(memory=EVICTING, upstream_url=picky.url)
    status, body = await post(gw, history())
    assert status == 400 and b"REFUSED" in body
    assert len(picky.seen) == 2
    ev = (await gw.wait_mem(1))[-1]
    assert ev["fallback"] == "original" and ev["first_status"] == "400" and ev["status"] == "400"


@pytest.mark.parametrize(
    ("status", "headers", "resent"),
    [
        (422, {}, True),
        (413, {}, False),  # the evicted body is smaller: the original is too large as well
        (400, {"Retry-After": "3"}, False),  # the upstream says when to come back
        (429, {"Retry-After": "3"}, False),  # a rate limit, not a refusal of the body
        (500, {}, False),
    ],
)
async def test_which_answers_resend(
    gateway: GatewayFactory, picky: Picky, status: int, headers: dict[str, str], resent: bool
) -> None:
    """Only a refusal of the body (400, 422; 413 when the original is not larger) without
    a Retry-After resends it; anything else is relayed as the upstream answered."""
    picky.status, picky.headers = status, headers
    gw = await gateway(memory=EVICTING, upstream_url=picky.url)
    got, body = await post(gw, history())
    assert len(picky.seen) == (2 if resent else 1)
    assert got == (200 if resent else status)
    if not resent:
        assert b"REFUSED" in body
    ev = (await gw.wait_mem(1))[-1]
    assert ev.get("first_status") == (str(status) if resent else None)


@pytest.mark.parametrize(
    ("status", "headers", "sent", "original", "expected"),
    [
        (400, {}, b"ab", b"abcd", True),
        (422, {}, b"ab", b"abcd", True),
        (413, {}, b"ab", b"abcd", False),  # the original is larger: it would be refused too
        (413, {}, b"abcd", b"abcd", True),
        (413, {}, b"abcde", b"abcd", True),  # a note made it larger than the original
        (400, {"Retry-After": "1"}, b"ab", b"abcd", False),
        (401, {}, b"ab", b"abcd", False),
        (429, {}, b"ab", b"abcd", False),
        (503, {}, b"ab", b"abcd", False),
    ],
)
def test_refuses_table(status: int, headers: dict[str, str], sent: bytes, original: bytes,
                       expected: bool) -> None:
    """The resend decision on the status line alone."""
    assert refuses(status, headers, sent, original) is expected


async def test_concurrent_fallbacks_send_each_original_once(
    gateway: GatewayFactory, picky: Picky
) -> None:
    """Concurrent refused requests: each original is sent once, each client gets a 200."""
    gw = await gateway(memory=EVICTING, upstream_url=picky.url)
    raws = [history().replace(b"question 0", b"question 0 #%d" % n) for n in range(8)]
    results = await asyncio.gather(*(post(gw, r) for r in raws))
    assert [s for s, _ in results] == [200] * 8
    assert sorted(b for b in picky.seen if b in raws) == sorted(raws)
    assert len(picky.seen) == 16


def test_refused_sessions_are_bounded_and_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backoff holds at most max_entries sessions (the least recently refused go
    first) and forgets each after its backoff; 0 marks nothing."""
    from gateway.proxy import appstate as gwstate

    now = [100.0]
    monkeypatch.setattr(gwstate.time, "monotonic", lambda: now[0])
    refused = gwstate.RefusedSessions(max_entries=2)
    for s in ("a", "b", "c"):
        refused.mark(("t", s), 10)
    assert len(refused) == 2 and not refused.holds(("t", "a"))
    assert refused.holds(("t", "b")) and refused.holds(("t", "c"))
    refused.mark(("t", "d"), 0)
    assert not refused.holds(("t", "d"))
    now[0] += 10.5
    assert not refused.holds(("t", "b")) and len(refused) == 1  # expired, and dropped
