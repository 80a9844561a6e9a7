"""One client session is one memgate session, through real HTTP: the anthropic SDK
sending Claude Code's ids, the openai SDK chaining Responses by `previous_response_id`
(one process, and two replicas sharing Redis), and as a property: an id a client sends
never reaches another tenant's state."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import uuid
from types import SimpleNamespace
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.memory.state import MemoryState, SessionRecord
from gateway.observe.relayed import Relayed
from gateway.proxy.session_record import remember_response, session_of
from gateway.wire.openai_responses import OPENAI_RESPONSES
from tests.conftest import (
    ANTHROPIC_REPLY,
    SECRET,
    GatewayFactory,
    anthropic_events,
    responses_events,
    responses_object,
)

REDIS_URL = os.environ.get("MEMGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CLAUDE_SID = "ca873c7d-c2ba-494f-9903-6d950670982d"
OTHER_SID = "5c0f9e1a-3b7d-4e2f-8a61-2d9c4b7e0f13"
DEVICE = "84d4fb45c7f21df3ebfb2d0a1e4d2ae8da840b420491e6ad4e75f1b62a0c560d"
CODEX_SID = "01a24995-6395-7d50-b2cb-981c96b27360"
MODES = [pytest.param({}, id="shadow"), pytest.param({"enable_eviction": True}, id="on")]


@pytest.fixture
async def model(aiohttp_server: Any) -> str:
    """An upstream for Messages and Responses whose every answer has an id of its own."""
    ids = itertools.count(1)

    async def messages(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in anthropic_events("Looking into it"):
                await resp.write(event)
            await resp.write_eof()
            return resp
        return web.json_response(ANTHROPIC_REPLY)

    async def responses(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = f"resp_{next(ids):04d}"
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for event in responses_events("streamed answer"):
                await resp.write(event.replace(b'"resp_test"', f'"{rid}"'.encode()))
            await resp.write_eof()
            return resp
        return web.json_response({**responses_object("an answer"), "id": rid})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def claude_turns(n: int) -> list[dict[str, Any]]:
    """Claude Code's messages after n answers: the opening's context blocks and task, the
    cache marker on the newest message only (it moves off the opening after request 1)."""
    opening = [{"type": "text", "text": "<system-reminder>\nAgents: general</system-reminder>"},
               {"type": "text", "text": "TASK1: look around the project"}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": opening}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": [{"type": "text", "text": f"Step {i}."}]},
                 {"role": "user", "content": [{"type": "text", "text": f"go on {i}"}]}]
    last = msgs[-1]["content"][-1]
    msgs[-1]["content"][-1] = {**last, "cache_control": {"type": "ephemeral"}}
    return msgs


SYSTEM = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": "Bash", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("memory", MODES)
async def test_claude_code_sessions_are_the_ids_it_sends(
    gateway: GatewayFactory, model: str, memory: dict[str, Any]
) -> None:
    """The anthropic SDK sending Claude Code's header and metadata.user_id: every request
    of a session (a streamed one, and a `--continue` from a new client) is that session,
    a second session with the same prompt is another; without the header, the session
    part of metadata.user_id (never the device); with neither, one fingerprint for the
    whole session although the cache marker moves."""
    gw = await gateway(memory=memory, upstream_url=model)
    user_id = json.dumps({"device_id": DEVICE, "account_uuid": "", "session_id": CLAUDE_SID})

    def claude(sid: str | None) -> anthropic.AsyncAnthropic:
        headers = {"X-Claude-Code-Session-Id": sid} if sid else {}
        return anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-ant-1", max_retries=0,
                                        default_headers=headers)

    async def ask(c: anthropic.AsyncAnthropic, n: int, meta: dict[str, str] | None) -> None:
        kw: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 100,
                              "system": SYSTEM, "tools": TOOLS, "messages": claude_turns(n)}
        if meta is not None:
            kw["metadata"] = meta
        if n == 1:  # Claude Code streams
            async with c.messages.stream(**kw) as s:
                await s.get_final_message()
        else:
            await c.messages.create(**kw)

    async with claude(CLAUDE_SID) as c:
        for n in range(3):
            await ask(c, n, {"user_id": user_id})
    async with claude(CLAUDE_SID) as c:  # claude --continue: a new process, the same id
        await ask(c, 3, {"user_id": user_id})
    async with claude(OTHER_SID) as c:  # another session, the same prompt
        await ask(c, 0, {"user_id": user_id.replace(CLAUDE_SID, OTHER_SID)})
    async with claude(None) as c:  # the older user_id string, no header
        await ask(c, 0, {"user_id": f"user_{DEVICE}_account__session_{OTHER_SID}"})
        for n in range(3):  # no id at all
            await ask(c, n, None)
    got = [(e["session"], e["session_from"]) for e in await gw.wait_mem(9)]
    header = "header:X-Claude-Code-Session-Id"
    assert got[:6] == [(CLAUDE_SID, header)] * 4 + [(OTHER_SID, header)] + [
        (OTHER_SID, "metadata.user_id.session_id")]
    fps = got[6:]
    assert fps[0][0].startswith("fp-") and fps == [(fps[0][0], "fingerprint")] * 3


async def responses_chain(c: openai.AsyncOpenAI, first: str, **kw: Any) -> list[str]:
    """A four-request Responses chain (the third one streamed); the answers' ids."""
    ids = [(await c.responses.create(model="gpt-4o-mini", input=first, **kw)).id]
    ids.append((await c.responses.create(model="gpt-4o-mini", input="and then?",
                                         previous_response_id=ids[-1])).id)
    stream = await c.responses.create(model="gpt-4o-mini", input="more", stream=True,
                                      previous_response_id=ids[-1])
    async for event in stream:
        if event.type == "response.completed":
            ids.append(event.response.id)
    ids.append((await c.responses.create(model="gpt-4o-mini", input="last",
                                         previous_response_id=ids[-1])).id)
    return ids


@pytest.mark.parametrize("memory", MODES)
async def test_responses_chains_stay_in_the_session_that_started_them(
    gateway: GatewayFactory, model: str, memory: dict[str, Any]
) -> None:
    """The openai SDK chaining by previous_response_id: each continuation (streamed or
    not, a fork from an earlier answer too) is the session of the request whose answer
    it continues, named by the header or the fingerprint; another chain is another
    session; a response id memgate does not know, or another tenant's, names none."""
    gw = await gateway(memory=memory, upstream_url=model)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET,
                                  max_retries=0) as c:
        one = await responses_chain(c, "Plan the migration.", instructions="Be brief.")
        two = await responses_chain(c, "Plan the migration.",
                                    extra_headers={"X-Session-Id": "s-chain"})
        await c.responses.create(model="gpt-4o-mini", input="fork", previous_response_id=one[1])
        await c.responses.create(model="gpt-4o-mini", input="?", previous_response_id="resp_x")
        codex = {"session-id": CODEX_SID}
        await c.responses.create(model="gpt-4o-mini", input="TASK1", extra_headers=codex,
                                 extra_body={"prompt_cache_key": CODEX_SID})
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="sk-another-tenant-key",
                                  max_retries=0) as other:
        await other.responses.create(model="gpt-4o-mini", input="and then?",
                                     previous_response_id=one[1])
    ev = [(e["session"], e["session_from"]) for e in await gw.wait_mem(12)]
    start = ev[0][0]
    assert start.startswith("fp-") and ev[0][1] == "fingerprint"
    assert ev[1:4] == [(start, "previous_response_id")] * 3
    assert ev[4] == ("s-chain", "header:X-Session-Id")
    assert ev[5:8] == [("s-chain", "previous_response_id")] * 3
    assert ev[8] == (start, "previous_response_id")  # a fork of the first chain
    assert ev[9][1] == "fingerprint" and ev[9][0] != start  # resp_x: unknown
    assert ev[10] == (CODEX_SID, "header:session-id")
    assert ev[11][1] == "fingerprint" and ev[11][0] not in (start, ev[9][0])
    assert len(set(one) | set(two)) == 8


async def test_replicas_sharing_redis_follow_each_others_chains(
    gateway: GatewayFactory, model: str
) -> None:
    """With state.backend: redis, a chain started on one replica and continued on the
    other stays one session: the answer's session is remembered in Redis."""
    import redis.asyncio as redis

    prefix = f"memgate-test-{uuid.uuid4().hex[:8]}"
    env = {"MEMGATE_REDIS_URL": REDIS_URL}
    state = {"backend": "redis", "key_prefix": prefix}
    a = await gateway(upstream_url=model, env=env, state=state)
    b = await gateway(upstream_url=model, env=env, state=state)
    try:
        async with openai.AsyncOpenAI(base_url=f"{a.url}/v1", api_key=SECRET,
                                      max_retries=0) as on_a, openai.AsyncOpenAI(
                base_url=f"{b.url}/v1", api_key=SECRET, max_retries=0) as on_b:
            first = await on_a.responses.create(model="gpt-4o-mini", input="hello",
                                                extra_headers={"X-Session-Id": "s-redis"})
            await a.wait_mem(1)  # its line follows the Redis write
            await on_b.responses.create(model="gpt-4o-mini", input="again",
                                        previous_response_id=first.id)
        ev = [(e["session"], e["session_from"])
              for e in [*await a.wait_mem(1), *await b.wait_mem(1)]]
        assert ev == [("s-redis", "header:X-Session-Id"), ("s-redis", "previous_response_id")]
    finally:
        r = redis.from_url(REDIS_URL)
        async for key in r.scan_iter(match=f"{prefix}:*"):
            await r.delete(key)
        await r.aclose()


# --- the tenant property ----------------------------------------------------------------

TENANTS = ("t-aaaaaaaaaaaaaaaa", "t-bbbbbbbbbbbbbbbb")
client_ids = st.sampled_from(["s1", "s2", "resp_0001", "resp_0002", "fp-0123456789abcdef"])
RECORD = SessionRecord(kept=(0, 1), n_messages=1, last=b"\0" * 8, cut=False, msg_tokens=3)


@st.composite
def requests(draw: st.DrawFn) -> tuple[dict[str, str], dict[str, Any]]:
    """Headers and a Responses body naming (or not) a session and an answer to continue."""
    headers = {"Authorization": "Bearer x"}
    if draw(st.booleans()):
        headers["X-Session-Id"] = draw(client_ids)
    body: dict[str, Any] = {"model": "m", "input": draw(st.sampled_from(["q", "r"]))}
    if draw(st.booleans()):
        body["previous_response_id"] = draw(client_ids)
    if draw(st.booleans()):
        body["conversation"] = draw(client_ids)
    return headers, body


@given(answered=st.lists(st.tuples(requests(), client_ids), min_size=1, max_size=6),
       probe=requests())
def test_a_client_sent_id_never_reaches_another_tenant(
    answered: list[tuple[tuple[dict[str, str], dict[str, Any]], str]],
    probe: tuple[dict[str, str], dict[str, Any]],
) -> None:
    """Tenant A's requests are answered (their answers' ids remembered with their
    sessions, their records kept); whatever ids tenant B then sends — the same headers,
    A's answer ids as previous_response_id — B resolves to what it would with no state
    of A's at all, and reads none of A's records. A itself follows its own chains."""
    rules = build_rules({})
    a, b = TENANTS

    async def run() -> None:
        state = SimpleNamespace(sessions=MemoryState(100), rules=rules)
        empty = SimpleNamespace(sessions=MemoryState(100), rules=rules)
        last: dict[str, str] = {}
        for (headers, body), answer_id in answered:
            req = make_mocked_request("POST", "/v1/responses", headers=headers)
            session, _ = await session_of(state, rules, req, body, None, a)  # type: ignore[arg-type]
            await state.sessions.put_record(a, session, RECORD)
            await remember_response(state, a, session, OPENAI_RESPONSES,  # type: ignore[arg-type]
                                    Relayed(status=200, response_id=answer_id))
            last[answer_id] = session
        headers, body = probe
        req = make_mocked_request("POST", "/v1/responses", headers=headers)
        got = await session_of(state, rules, req, body, None, b)  # type: ignore[arg-type]
        assert got == await session_of(empty, rules, req, body, None, b)  # type: ignore[arg-type]
        assert await state.sessions.get_record(b, got[0]) is None
        mine = await session_of(state, rules, req, body, None, a)  # type: ignore[arg-type]
        prev = body.get("previous_response_id")
        if "X-Session-Id" not in headers and prev in last:
            assert mine == (last[prev], "previous_response_id")

    asyncio.run(run())


def test_an_answer_is_remembered_only_for_responses_that_succeeded() -> None:
    """Chat answers, refused ones, callers without a tenant and configs without the
    source keep nothing (the chain has nothing to follow there)."""
    from gateway.wire.openai_chat import OPENAI_CHAT

    async def run() -> list[int]:
        sizes = []
        for wire, status, tenant, sources in (
                (OPENAI_RESPONSES, 200, "t-a", None), (OPENAI_CHAT, 200, "t-a", None),
                (OPENAI_RESPONSES, 400, "t-a", None), (OPENAI_RESPONSES, 200, None, None),
                (OPENAI_RESPONSES, 200, "t-a", ["user", "fingerprint"])):
            rules = build_rules({"session": {"id_from": sources}} if sources else {})
            state = SimpleNamespace(sessions=MemoryState(10), rules=rules)
            await remember_response(state, tenant, "s", wire,  # type: ignore[arg-type]
                                    Relayed(status=status, response_id="resp_1"))
            sizes.append(len(state.sessions.responses))
        return sizes

    assert asyncio.run(run()) == [1, 0, 0, 0, 0]
