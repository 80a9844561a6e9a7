"""Two gateway replicas sharing Redis (session state) and PostgreSQL (memory store)."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import PG_DSN, SECRET, GatewayFactory, Upstream, pg_schema

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("MEMGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def history(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a data assistant."},
        {"role": "user", "content": "Summarize last week's orders in /data/orders by status and "
                                    "write it to report_0421.csv. Project codename KESTREL."},
        {"role": "assistant", "content": "Grouping by status. Should I exclude cancelled orders?"},
        {"role": "user", "content": "Don't exclude them, run it on that path."},
        {"role": "assistant", "content": "Running."},
    ]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Progress {t}? " + "details please. " * 25},
                 {"role": "assistant", "content": f"Step {t} is still running. " * 25}]
    return msgs


@pytest.fixture
async def shared(gateway: GatewayFactory) -> Any:
    import redis.asyncio as redis

    prefix = f"memgate-test-{uuid.uuid4().hex[:8]}"
    async with pg_schema() as (schema, _):
        env = {"MEMGATE_REDIS_URL": REDIS_URL,
               "MEMGATE_STORE_DSN": f"{PG_DSN}?options=-csearch_path%3D{schema}",
               "MEMGATE_ADMIN_TOKEN": "adm"}
        memory = {"enable_eviction": True,
                  "budget": {"max_tokens": 1500, "max_chars": None, "max_messages": None,
                             "max_turns": None},
                  "carry": {"enabled": True, "rules_file": str(ROOT / "rules" / "carry.yaml")}}
        top = {"state": {"backend": "redis", "key_prefix": prefix},
               "store": {"backend": "postgres", "archive": "evicted",
                         "recall": {"enabled": True, "top_k": 2}}}
        a = await gateway(memory=memory, env=env, **top)
        b = await gateway(memory=memory, env=env, **top)
        yield a, b
        for gw in (a, b):  # flush the archive writers before the schema goes
            await gw.server.close()
    r = redis.from_url(REDIS_URL)
    async for key in r.scan_iter(match=f"{prefix}:*"):
        await r.delete(key)
    await r.aclose()


async def post(url: str, messages: list[dict[str, Any]]) -> None:
    async with aiohttp.ClientSession() as s, s.post(
        f"{url}/v1/chat/completions", data=orjson.dumps({"model": "gpt-4o-mini",
                                                         "messages": messages}),
        headers={"Authorization": f"Bearer {SECRET}", "X-Session-Id": "s-shared"},
    ) as r:
        assert r.status == 200
        await r.read()


async def test_a_session_continues_across_replicas(shared: Any, upstream: Upstream) -> None:
    """Request 1 on replica A, request 2 on replica B: B knows A's cut and token sums, shows
    A's carry snapshot, and recalls the turn A archived — even when the client trimmed it."""
    a, b = shared
    first = [*history(20), {"role": "user", "content": "Any blockers?"}]
    await post(a.url, first)
    await a.wait_mem(1)  # A's accounting (it queues the archive) follows its answer
    await a.state.memory.queue.join()  # A's write-behind archive reached PostgreSQL
    second = [*first, {"role": "assistant", "content": "None."},
              {"role": "user", "content": "Thanks, keep going."}]
    await post(b.url, second)
    ev_a, ev_b = (await a.wait_mem(1))[-1], (await b.wait_mem(1))[-1]
    assert int(ev_a["archived"]) > 0 and int(ev_a["dropped"]) > 0
    assert ev_b["cut"] in ("kept", "moved") and int(ev_b["prefix_tokens"]) > 0
    async with aiohttp.ClientSession() as s, s.get(
            f"{b.url}/admin/sessions/s-shared/memory",
            headers={"X-Memgate-Admin-Token": "adm"}) as r:
        snap = (await r.json())["tenants"]
    assert r.status == 200 and next(iter(snap.values()))["output_file"] == "report_0421.csv"
    # a client that trimmed its own history: only B's store recall can bring KESTREL back
    trimmed = [first[0], *history(20)[-6:],
               {"role": "user", "content": "What is the project codename again?"}]
    await post(b.url, trimmed)
    sent = orjson.loads(upstream.received[-1]["raw"])["messages"]
    assert "KESTREL" not in " ".join(str(m["content"]) for m in trimmed)
    assert any("KESTREL" in str(m["content"]) for m in sent)
    assert int((await b.wait_mem(2))[-1]["recalled_records"]) >= 1


async def test_accounting_survives_a_client_that_closes_at_once(shared: Any) -> None:
    """With Redis state the [mem] line and the session record are written after awaits:
    40 concurrent clients that close their connection right after the body all get
    accounted (the accounting is shielded from handler cancellation)."""
    a, _ = shared

    async def one(k: int) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.post(f"{a.url}/v1/chat/completions",
                              data=orjson.dumps({"model": "gpt-4o-mini",
                                                 "messages": history(3)[:2]}),
                              headers={"Authorization": f"Bearer {SECRET}",
                                       "X-Session-Id": f"s-close-{k}"}) as r:
                await r.read()

    await asyncio.gather(*(one(k) for k in range(40)))
    assert len(await a.wait_mem(40)) == 40


async def test_a_record_written_before_runs_reads_the_same() -> None:
    """A session record an earlier version wrote (`rec`, `kept`: every index) reads as
    the runs this one writes; this one's round-trips under a key of its own (`rec2`: an
    earlier replica never reads it, as it would with KeyError 'kept' during a rolling
    update), and is read before the earlier one's."""
    import redis.asyncio as redis

    from gateway.memory.backends import Backend
    from gateway.memory.state import RedisState, SessionRecord, compare_cut

    prefix = f"memgate-test-{uuid.uuid4().hex[:8]}"
    state = RedisState(REDIS_URL, 60, prefix, Backend("state", lambda: None), 1.0, 1.0)
    old = {"kept": [0, 1, 2, 7, 8], "n": 9, "last": "00" * 8, "cut": True, "tok": 90,
           "before_last": "11" * 8, "tok_before_last": 80}
    r = redis.from_url(REDIS_URL)
    try:
        await r.set(f"{prefix}:rec:t-a:s-1", orjson.dumps(old), ex=60)
        was = await state.get_record("t-a", "s-1")
        assert was is not None and was.kept == (0, 3, 7, 9)
        assert compare_cut(was, 9, [0, 1, 2, 7, 8, 9, 10], True) == ("kept", 5)
        assert compare_cut(was, 9, [0, 1, 7, 8, 9], True) == ("moved", 2)
        rec = SessionRecord(kept=(0, 4), n_messages=4, last=b"\x01" * 8, cut=False,
                            msg_tokens=40)
        await state.put_record("t-a", "s-2", rec)
        assert await state.get_record("t-a", "s-2") == rec
        assert await r.get(f"{prefix}:rec:t-a:s-2") is None  # the earlier key is not written
        await state.put_record("t-a", "s-1", rec)  # over the earlier version's record
        assert await state.get_record("t-a", "s-1") == rec
    finally:
        async for key in r.scan_iter(match=f"{prefix}:*"):
            await r.delete(key)
        await r.aclose()
        await state.close()


@pytest.mark.parametrize("prefix_head", ["memgate-test", "mg:prod*[x]"])
async def test_snapshots_are_found_whatever_the_prefix_and_session_hold(
    prefix_head: str,
) -> None:
    """The admin look-up of a session's carry snapshots by tenant: a key prefix with
    ":" (or glob characters) and a session id with ":" find every tenant's snapshot
    and no other session's (the tenant was the key's third ":" field: {} for mg:prod)."""
    from gateway.memory.backends import Backend
    from gateway.memory.state import RedisState

    prefix = f"{prefix_head}-{uuid.uuid4().hex[:8]}"
    state = RedisState(REDIS_URL, 60, prefix, Backend("state", lambda: None), 1.0, 1.0)
    try:
        await state.put_snapshot("t-a", "team:run:7", {"files": ["a.py"]})
        await state.put_snapshot("t-b", "team:run:7", {"files": ["b.py"]})
        await state.put_snapshot("t-a", "run:7", {"files": ["other session"]})
        await state.put_snapshot("t-a", "team:run:77", {"files": ["other session"]})
        assert await state.find_snapshots("team:run:7") == {
            "t-a": {"files": ["a.py"]}, "t-b": {"files": ["b.py"]}}
        assert await state.find_snapshots("run:7") == {"t-a": {"files": ["other session"]}}
    finally:
        async for key in state.client.scan_iter(match=f"{prefix.split(':')[0]}*"):
            if key.decode().startswith(prefix):
                await state.client.delete(key)
        await state.close()


async def test_a_burst_past_the_redis_pool_waits_for_a_connection(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """300 requests at once, each reading and writing its session's record: a healthy
    Redis is never marked down (redis-py's default pool raised MaxConnectionsError past
    100 connections, which tripped the breaker: 868 of 4,019 lines state=unavailable)."""
    import redis.asyncio as redis

    prefix = f"memgate-test-{uuid.uuid4().hex[:8]}"
    # generous timeouts: this process is client, gateway and upstream at once, and its
    # loop lags under the burst; what is tested is the pool, which refused at once
    gw = await gateway(memory={"enable_eviction": True}, env={"MEMGATE_REDIS_URL": REDIS_URL},
                       state={"backend": "redis", "key_prefix": prefix,
                              "connect_timeout_s": 10, "read_timeout_s": 10})
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": history(2)})

    async def one(s: aiohttp.ClientSession, k: int) -> int:
        async with s.post(f"{gw.url}/v1/chat/completions", data=body, headers={
                "Authorization": f"Bearer {SECRET}", "X-Session-Id": f"burst-{k}"}) as r:
            await r.read()
            return r.status

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            statuses = await asyncio.gather(*(one(s, k) for k in range(300)))
        assert statuses == [200] * 300
        events = await gw.wait_mem(300)
        assert [e for e in events if e.get("state") == "unavailable"] == []
        assert "backend_error" not in gw.log.getvalue()
    finally:
        r = redis.from_url(REDIS_URL)
        async for key in r.scan_iter(match=f"{prefix}:*"):
            await r.delete(key)
        await r.aclose()
