"""Tenant isolation by credential through real HTTP: every way a caller can carry its key,
keyless callers, and the client allowlist of routes that get the gateway's own key."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from tests.conftest import ROOT, Gateway, GatewayFactory, Upstream

SYSTEM = "You are a careful assistant."
OPENING = ("Hello, let's start the weekly planning.", "Hi! Ready when you are.")
SECRET_TURN = ("Remember this: the vault code is ZEBRA-7731. Write it to /data/vault/v.csv.",
               "Noted, the vault code is stored.")
QUESTION = "What is the vault code again?"
KEYS = {"A": "sk-tenant-A-0123456789", "B": "sk-tenant-B-9876543210"}
# every way a caller can present (or fail to present) its key
KINDS = ("bearer", "x-api-key", "api-key", "configured", "none", "empty-bearer")
KEYLESS = ("none", "empty-bearer")
BUDGET = {"max_tokens": 900, "max_chars": None, "max_messages": None, "max_turns": None}
STORE_ON = {"archive": "all", "recall": {"enabled": True, "top_k": 3}}
TENANTS = {"credential_headers": ["X-Client-Key"]}


def history(with_secret: bool, fillers: int = 14) -> list[tuple[str, str]]:
    """(user, assistant) turns: one caller tells the secret early, the other does not."""
    turns = [OPENING] + ([SECRET_TURN] if with_secret else [])
    turns += [(f"Filler question {i} about the roadmap. " + "more detail " * 25,
               f"Filler answer {i}. " + "roadmap text " * 25) for i in range(fillers)]
    return turns


def openai_messages(turns: list[tuple[str, str]]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": QUESTION}]


def anthropic_messages(turns: list[tuple[str, str]]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for u, a in turns:
        msgs += [{"role": "user", "content": u},
                 {"role": "assistant", "content": [{"type": "text", "text": a}]}]
    return msgs + [{"role": "user", "content": QUESTION}]


async def send(gw: Gateway, kind: str, key: str, turns: list[tuple[str, str]],
               session: str | None) -> None:
    """One chat request the way a client of that kind sends it (real SDKs where one fits)."""
    extra = {"X-Session-Id": session} if session else {}
    if kind == "bearer":
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0,
                                      default_headers=extra) as c:
            await c.chat.completions.create(model="gpt-4o-mini", messages=openai_messages(turns))
        return
    if kind == "x-api-key":
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0,
                                            default_headers=extra) as c:
            await c.messages.create(model="claude-3-5-haiku-20241022", max_tokens=64,
                                    system=SYSTEM, messages=anthropic_messages(turns))
        return
    headers = {"Content-Type": "application/json", **extra,
               **{"api-key": {"api-key": key}, "configured": {"X-Client-Key": key},
                  "none": {}, "empty-bearer": {"Authorization": "Bearer "}}[kind]}
    body = {"model": "gpt-4o-mini", "messages": openai_messages(turns)}
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
        assert r.status == 200, await r.text()


async def flushed(gw: Gateway, requests: int) -> None:
    """Wait until the archive of the first `requests` requests is written (each queues its
    records before its [mem] line)."""
    await gw.wait_mem(requests)
    await asyncio.wait_for(gw.state.memory.queue.join(), 10)


def stored(db: Path) -> list[tuple[str, str, str]]:
    """(tenant, text, session) of every archived record."""
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        return con.execute("SELECT tenant, text, session_id FROM memories").fetchall()


async def start(gateway: GatewayFactory, tmp_path: Path, tenants: dict[str, Any] | None = None,
                **top: Any) -> tuple[Gateway, Path]:
    db = tmp_path / "m.db"
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET},
                       store={"path": str(db), **STORE_ON}, tenants=tenants or TENANTS, **top)
    return gw, db


@pytest.mark.parametrize("a, b", [(a, b) for a in KINDS for b in KINDS])
async def test_a_secret_never_reaches_another_credentials_upstream_request(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, a: str, b: str
) -> None:
    """Caller A tells the secret, caller B (another key, or none) asks for it in the same
    session id: B's upstream request never holds it, whatever header each key came in."""
    gw, db = await start(gateway, tmp_path)
    await send(gw, a, KEYS["A"], history(with_secret=True), "shared-session")
    await flushed(gw, 1)
    if a in KEYLESS:  # no credential: nothing of the request is kept
        assert stored(db) == []
    else:
        assert any("ZEBRA-7731" in text for _, text, _ in stored(db))
    seen = len(upstream.received)
    await send(gw, b, KEYS["B"], history(with_secret=False), "shared-session")
    assert len(upstream.received) == seen + 1
    assert b"ZEBRA" not in upstream.received[-1]["raw"]
    ev = (await gw.wait_mem(2))[-1]
    if b in KEYLESS:  # nothing recalled, nothing archived for a keyless caller
        assert "recalled_records" not in ev and "archived" not in ev


@pytest.mark.parametrize("a, b", [("bearer", "x-api-key"), ("api-key", "configured"),
                                  ("bearer", "bearer")])
async def test_the_same_key_in_any_header_is_one_tenant(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, a: str, b: str
) -> None:
    """The control: one key, whichever header carries it, recalls its own secret (so the
    isolation above is not recall simply never working)."""
    gw, _ = await start(gateway, tmp_path)
    await send(gw, a, KEYS["A"], history(with_secret=True), "shared-session")
    await flushed(gw, 1)
    await send(gw, b, KEYS["A"], history(with_secret=False), "shared-session")
    assert b"ZEBRA-7731" in upstream.received[-1]["raw"]


async def test_conversations_that_start_alike_share_nothing_across_keys(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """No session id: the fingerprint of the conversation start is per tenant, so an
    Azure-style caller and a keyless one with the same opening never meet."""
    gw, db = await start(gateway, tmp_path)
    await send(gw, "api-key", KEYS["A"], history(with_secret=True), None)
    await flushed(gw, 1)
    await send(gw, "none", "", history(with_secret=False), None)
    await send(gw, "api-key", KEYS["B"], history(with_secret=False), None)
    assert all(b"ZEBRA" not in r["raw"] for r in upstream.received[1:])
    await flushed(gw, 3)
    tenant_a, tenant_b = ("t-" + hashlib.sha256(KEYS[k].encode()).hexdigest()[:16] for k in "AB")
    rows = stored(db)
    assert {t for t, _, _ in rows} == {tenant_a, tenant_b}  # the keyless caller archived nothing
    assert {t for t, text, _ in rows if "ZEBRA" in text} == {tenant_a}


async def test_keyless_callers_share_no_session_state(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """Two keyless callers in one session id: no carry snapshot is kept, and the second
    one's cut is not taken for the first's (a keyed caller's are, the control)."""
    carry = {"enabled": True, "rules_file": str(ROOT / "rules" / "carry.yaml")}
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET, "carry": carry,
                               "eviction": {"recall_share": 0}},  # the stepped cut alone
                       env={"MEMGATE_ADMIN_TOKEN": "adm-token"})
    for kind, session in (("none", "kl"), ("none", "kl"), ("bearer", "keyed"),
                          ("bearer", "keyed")):
        await send(gw, kind, KEYS["A"], history(with_secret=True), session)
    ev = await gw.wait_mem(4)
    assert [e["cut"] for e in ev] == ["moved", "moved", "moved", "kept"]
    assert all(int(e["carried"]) > 0 for e in ev)  # each note is built from its own request
    async with aiohttp.ClientSession() as s:
        for session, status in (("kl", 404), ("keyed", 200)):
            async with s.get(f"{gw.url}/admin/sessions/{session}/memory",
                             headers={"X-Memgate-Admin-Token": "adm-token"}) as r:
                assert r.status == status, session


@pytest.mark.parametrize("anonymous", [None, "lab-shared"])
async def test_keyless_callers_are_told_once_never_with_the_value(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, anonymous: str | None
) -> None:
    """The first chat request without a usable key logs one warning naming the way out
    (tenants.anonymous); later ones, keyed ones and a mapped anonymous tenant log none.
    The header's value never appears (a bad key may be a real one, mangled)."""
    gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET},
                       tenants={"anonymous": anonymous} if anonymous else {})
    await send(gw, "bearer", KEYS["A"], history(with_secret=False), "s")
    await gw.wait_mem(1)
    assert "keyless_callers" not in gw.log.getvalue()  # a keyed caller is no reason
    body = {"model": "gpt-4o-mini", "messages": openai_messages(history(False))}
    async with aiohttp.ClientSession() as s, s.post(  # the first: a placeholder to look for
            f"{gw.url}/v1/chat/completions", data=orjson.dumps(body),
            headers={"x-api-key": "sk-no-key-required"}) as r:
        assert r.status == 200
    for kind in ("none", "empty-bearer"):
        await send(gw, kind, "", history(with_secret=False), "s")
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-fake",
                                  max_retries=0) as c:
        await c.chat.completions.create(model="gpt-4o-mini",
                                        messages=openai_messages(history(False)))
    await gw.wait_mem(5)
    warned = [ln for ln in gw.log.getvalue().splitlines() if "keyless_callers" in ln]
    if anonymous:
        assert warned == []
        return
    assert len(warned) == 1, warned
    assert "tenants.anonymous" in warned[0] and "warning" in warned[0]
    assert KEYS["A"] not in gw.log.getvalue() and "Bearer" not in warned[0]
    assert "sk-no-key-required" not in warned[0]


async def test_anonymous_mapping_gives_keyless_callers_one_named_tenant(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """tenants.anonymous: keyless callers share that tenant's memory (and only theirs)."""
    gw, db = await start(gateway, tmp_path, tenants={**TENANTS, "anonymous": "lab-shared"})
    await send(gw, "none", "", history(with_secret=True), "lab")
    await flushed(gw, 1)
    await send(gw, "empty-bearer", "", history(with_secret=False), "lab")
    assert b"ZEBRA-7731" in upstream.received[-1]["raw"]
    await send(gw, "bearer", KEYS["B"], history(with_secret=False), "lab")
    assert b"ZEBRA" not in upstream.received[-1]["raw"]
    await flushed(gw, 3)
    assert {t for t, text, _ in stored(db) if "ZEBRA" in text} == {"lab-shared"}


async def memory_api(gw: Gateway, method: str, path: str, headers: dict[str, str],
                     body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(
            method, f"{gw.url}/v1/memories{path}", headers=headers,
            data=None if body is None else orjson.dumps(body)) as r:
        return r.status, orjson.loads(await r.read())


RECORD = {"memory_type": "message", "agent_id": "a", "session_id": "s1", "role": "user",
          "ts": "2026-11-29T10:00:00Z", "text": "the vault code is ZEBRA-7731"}
SEARCH = {"filter": {"session_id": "s1", "time_from": "2026-11-29T00:00:00Z"},
          "query": "vault code"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer "}, {"Authorization": "Bearer"},
                                     {"x-api-key": "   "}, {"api-key": ""},
                                     {"Authorization": "Bearer undefined"},
                                     {"Authorization": "Bearer EMPTY"},
                                     {"x-api-key": "sk-no-key-required"}])
async def test_memory_api_refuses_callers_without_a_usable_key(
    gateway: GatewayFactory, tmp_path: Path, headers: dict[str, str]
) -> None:
    """Keyless, empty or placeholder credentials: 401 in the API's error shape."""
    gw, _ = await start(gateway, tmp_path)
    for method, path, body in (("POST", "", RECORD), ("POST", "/search", SEARCH),
                               ("GET", "/some-id", None), ("DELETE", "/some-id", None)):
        status, err = await memory_api(gw, method, path, headers, body)
        assert status == 401, (method, path)
        assert err["error"]["code"] == "unauthorized" and err["error"]["type"] == "gateway_error"


async def test_memory_api_tenant_comes_from_any_credential_header(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """An api-key or configured-header caller has its own records; a mapped keyless
    caller has the anonymous tenant's, and none of them sees another's."""
    gw = await gateway(store={"path": str(tmp_path / "m.db")},
                       tenants={**TENANTS, "anonymous": "lab-shared"})
    azure, custom, bearer = ({"api-key": KEYS["A"]}, {"X-Client-Key": KEYS["B"]},
                             {"Authorization": f"Bearer {KEYS['A']}"})
    status, made = await memory_api(gw, "POST", "", azure, RECORD)
    assert status == 201
    assert (await memory_api(gw, "GET", f"/{made['memory_id']}", bearer))[0] == 200  # same key
    for other in (custom, {}):
        assert (await memory_api(gw, "GET", f"/{made['memory_id']}", other))[0] == 404
        status, found = await memory_api(gw, "POST", "/search", other, SEARCH)
        assert status == 200 and found["results"] == []


async def raw_request(gw: Gateway, method: str, path: str, headers: list[bytes],
                      body: bytes = b"") -> tuple[int, bytes]:
    """One request written byte for byte on a socket (header values no client library
    would send), and the status and body of the answer."""
    r, w = await asyncio.open_connection(gw.server.host, gw.server.port)
    try:
        w.write(b"%s %s HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n" % (
            method.encode(), path.encode()) + b"".join(h + b"\r\n" for h in headers)
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await w.drain()
        answer = await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


CHAT_BODY = orjson.dumps({"model": "gpt-4o-mini", "messages": openai_messages(history(True, 2))})
MESSAGES_BODY = orjson.dumps({"model": "claude-3-5-haiku-20241022", "max_tokens": 16,
                              "messages": anthropic_messages(history(True, 2))})


@pytest.mark.parametrize("header", [b"Authorization: Bearer \xff\xfe-key", b"x-api-key: k\xe9y",
                                    b"api-key: \xc3\x28", b"Authorization: \x80"])
async def test_non_utf8_credentials_are_no_credential_not_a_500(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, header: bytes
) -> None:
    """Non-UTF-8 bytes in a credential header: no tenant, and the request is refused
    with a 400 naming the header (the HTTP client would drop those bytes: the key would
    reach the upstream changed), nothing stored; the memory API answers 401. Never a
    500."""
    gw, db = await start(gateway, tmp_path, env={"MEMGATE_ADMIN_TOKEN": "adm-token"})
    name = header.split(b":")[0].decode()
    for path, body in (("/v1/chat/completions", CHAT_BODY), ("/v1/messages", MESSAGES_BODY)):
        status, answer = await raw_request(gw, "POST", path, [header], body)
        assert status == 400 and f"header '{name}'" in orjson.loads(answer)["error"]["message"]
    assert upstream.received == []
    assert stored(db) == []
    status, answer = await raw_request(gw, "POST", "/v1/memories", [header], orjson.dumps(RECORD))
    assert status == 401 and orjson.loads(answer)["error"]["code"] == "unauthorized"


async def test_non_utf8_admin_token_is_a_401(gateway: GatewayFactory, tmp_path: Path) -> None:
    """The admin token header compared as the bytes sent: a wrong one with non-UTF-8 bytes
    is a 401 like any wrong one."""
    gw, _ = await start(gateway, tmp_path, env={"MEMGATE_ADMIN_TOKEN": "adm-token"})
    status, answer = await raw_request(gw, "GET", "/admin/sessions/s1/memory",
                                       [b"X-Memgate-Admin-Token: adm-\xff\xfe"])
    assert status == 401 and orjson.loads(answer)["error"]["code"] == "unauthorized"


INJECTED = {"openai": "sk-gateway-openai-INJECTED", "anthropic": "sk-gateway-anthropic-INJECTED"}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def injecting_upstreams(url: str, models: list[str] | None = None) -> list[dict[str, Any]]:
    """Both APIs relayed with the gateway's own keys (from the environment)."""
    ups: list[dict[str, Any]] = [
        {"name": "anthropic", "base_url": url, "paths": ["/v1/messages*"],
         "api_key_env": "MEMGATE_TEST_INJECTED_ANTHROPIC", "api_key_header": "x-api-key"},
        {"name": "openai", "base_url": url, "paths": ["/*"],
         "api_key_env": "MEMGATE_TEST_INJECTED_OPENAI"}]
    if models is not None:  # the injecting one chooses by model; the default does not inject
        ups[1]["models"] = models
        ups.append({"name": "plain", "base_url": url, "paths": ["/*"]})
    return ups


@pytest.fixture
def injected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMGATE_TEST_INJECTED_OPENAI", INJECTED["openai"])
    monkeypatch.setenv("MEMGATE_TEST_INJECTED_ANTHROPIC", INJECTED["anthropic"])


async def test_injected_key_serves_allowlisted_clients_only(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, injected: None
) -> None:
    """A route that gets the gateway's key: an allowlisted client key is served with the
    gateway's key in its place; any other key, or none, is a 401 in the API's own error
    shape and nothing is forwarded."""
    gw, _ = await start(gateway, tmp_path, upstreams=injecting_upstreams(upstream.url),
                        tenants={**TENANTS, "client_keys_sha256": [sha(KEYS["A"])]})
    for kind in ("bearer", "x-api-key", "api-key", "configured"):
        await send(gw, kind, KEYS["A"], history(False, 1), None)
    chat, messages, azure, custom = (r["headers"] for r in upstream.received)
    assert chat["Authorization"] == f"Bearer {INJECTED['openai']}"
    assert messages["x-api-key"] == INJECTED["anthropic"]
    assert azure["Authorization"] == f"Bearer {INJECTED['openai']}" and "api-key" not in azure
    assert custom["Authorization"] == f"Bearer {INJECTED['openai']}"
    assert "X-Client-Key" not in custom  # the client's own credential stays here
    assert all(KEYS["A"] not in str(dict(r["headers"])) for r in upstream.received)

    with pytest.raises(openai.AuthenticationError) as oe:
        await send(gw, "bearer", KEYS["B"], history(False, 1), None)
    assert oe.value.status_code == 401
    assert oe.value.body["code"] == "unauthorized"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as ae:
        await send(gw, "x-api-key", KEYS["B"], history(False, 1), None)
    assert ae.value.body == {"type": "error", "error": {  # type: ignore[comparison-overlap]
        "type": "authentication_error",
        "message": "your key is not on this gateway's client allowlist"}}
    for headers in ({}, {"Authorization": "Bearer "}, {"api-key": KEYS["B"]}):
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{gw.url}/v1/chat/completions", data=CHAT_BODY,
                              headers=headers) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "unauthorized"
            async with s.get(f"{gw.url}/v1/models", headers=headers) as r:  # passthrough
                assert r.status == 401
    assert len(upstream.received) == 4  # nothing of the refused requests went upstream
    # a refused keyless caller is told 401, not that tenants.anonymous would serve it
    assert "keyless_callers" not in gw.log.getvalue()
    async with aiohttp.ClientSession() as s, s.get(
            f"{gw.url}/v1/models", headers={"Authorization": f"Bearer {KEYS['A']}"}) as r:
        assert r.status == 200
    assert upstream.received[-1]["headers"]["Authorization"] == f"Bearer {INJECTED['openai']}"


async def test_a_refused_caller_of_a_model_routed_upstream_leaves_no_memory(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, injected: None
) -> None:
    """An upstream chosen by model is known once the body is read: a caller refused there
    gets its 401 and nothing of the request is archived; other models go to the plain
    upstream with the caller's own key."""
    gw, db = await start(gateway, tmp_path, tenants={"client_keys_sha256": [sha(KEYS["A"])]},
                         upstreams=injecting_upstreams(upstream.url, models=["gpt-4o*"]))
    with pytest.raises(openai.AuthenticationError):
        await send(gw, "bearer", KEYS["B"], history(True), "s-refused")
    assert upstream.received == []
    ev = (await gw.wait_mem(1))[-1]
    assert ev["status"] == "401" and "archived" not in ev
    body = orjson.dumps({"model": "llama-3", "messages": openai_messages(history(True))})
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=body,
            headers={"Authorization": f"Bearer {KEYS['B']}"}) as r:
        assert r.status == 200
    assert upstream.received[-1]["headers"]["Authorization"] == f"Bearer {KEYS['B']}"
    await flushed(gw, 2)
    rows = stored(db)
    assert rows and all(session != "s-refused" for _, _, session in rows)


async def test_injected_key_without_an_allowlist_is_refused_unless_opted_out(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, injected: None
) -> None:
    """No client keys configured: the injecting routes answer 401 and the startup log says
    why; tenants.allow_any_client opens them (and the log says what that means)."""
    gw, _ = await start(gateway, tmp_path, upstreams=injecting_upstreams(upstream.url))
    with pytest.raises(openai.AuthenticationError) as oe:
        await send(gw, "bearer", KEYS["A"], history(False, 1), None)
    assert "tenants.client_keys_sha256" in oe.value.message
    assert upstream.received == []
    assert "injected_key_unguarded" in gw.log.getvalue()
    assert "its routes answer 401" in gw.log.getvalue()
    await gw.server.close()
    gw, _ = await start(gateway, tmp_path, upstreams=injecting_upstreams(upstream.url),
                        tenants={"allow_any_client": True})
    await send(gw, "none", "", history(False, 1), None)
    assert upstream.received[-1]["headers"]["Authorization"] == f"Bearer {INJECTED['openai']}"
    assert "anyone who reaches the port spends it" in gw.log.getvalue()


async def test_client_keys_from_the_environment(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path, injected: None
) -> None:
    """MEMGATE_CLIENT_KEYS_SHA256 (comma or space separated) adds to the config's list."""
    gw, _ = await start(gateway, tmp_path, upstreams=injecting_upstreams(upstream.url),
                        tenants={"client_keys_sha256": [sha("sk-someone-else")]},
                        env={"MEMGATE_CLIENT_KEYS_SHA256": f"{sha('x')}, {sha(KEYS['B'])}"})
    await send(gw, "bearer", KEYS["B"], history(False, 1), None)
    with pytest.raises(openai.AuthenticationError):
        await send(gw, "bearer", KEYS["A"], history(False, 1), None)
    assert len(upstream.received) == 1
