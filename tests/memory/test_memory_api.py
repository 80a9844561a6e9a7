"""The memory store through the gateway: HTTP API, archiving evicted turns, recall."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.config.schema import TenantRules
from gateway.memory.session import tenant_of
from gateway.memory.store.model import Filter
from gateway.memory.store.sqlite import SqliteStore
from tests.conftest import PG_DSN, SECRET, GatewayFactory, Upstream, pg_schema

AUTH = {"Authorization": f"Bearer {SECRET}"}
OTHER = {"Authorization": "Bearer sk-another-tenant"}


async def call(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None
               ) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(
        method, url, headers=headers or {},
        data=None if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    ) as r:
        return r.status, orjson.loads(await r.read())


async def test_write_search_get_delete_and_tenants(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """The HTTP API round-trips records, scopes them by the caller's key, explains errors."""
    gw = await gateway(store={"path": str(tmp_path / "m.db"), "max_chars_per_record": 50,
                              "on_overlong": "reject"})
    base = f"{gw.url}/v1/memories"
    rec = {"memory_type": "turn", "agent_id": "a1", "session_id": "session-A",
           "ts": "2026-11-29T10:00:00+08:00", "user_text": "预算 10 万", "assistant_text": "好的",
           "tags": ["budget"]}
    status, made = await call("POST", base, rec, AUTH)
    assert status == 201
    mid = made["memory_id"]
    status, found = await call("POST", f"{base}/search", {
        "filter": {"session_id": "session-A", "time_from": "2026-11-29T00:00:00Z",
                   "time_to": "2026-11-30T00:00:00Z"}, "query": "预算"}, AUTH)
    assert status == 200 and [r["memory_id"] for r in found["results"]] == [mid]
    assert found["results"][0]["ts"] == "2026-11-29T02:00:00+00:00"  # stored in UTC
    status, got = await call("GET", f"{base}/{mid}", headers=AUTH)
    assert status == 200 and got["user_text"] == "预算 10 万"
    assert (await call("GET", f"{base}/{mid}", headers=OTHER))[0] == 404
    status, err = await call("GET", f"{base}/{mid}")
    assert status == 401 and err["error"]["code"] == "unauthorized"
    status, err = await call("POST", base, {**rec, "ts": "2026-11-29T10:00:00"}, AUTH)
    assert status == 400 and "without a timezone" in err["error"]["message"]
    status, err = await call("POST", base, {**rec, "user_text": "x" * 80}, AUTH)
    assert status == 413 and "limit is 50" in err["error"]["message"]
    status, err = await call("POST", f"{base}/search", {"query": "预算"}, AUTH)
    assert status == 400 and "cross-session" in err["error"]["message"]
    assert (await call("DELETE", f"{base}/{mid}", headers=OTHER))[0] == 404
    assert (await call("DELETE", f"{base}/{mid}", headers=AUTH))[0] == 200
    assert (await call("GET", f"{base}/{mid}", headers=AUTH))[0] == 404


async def test_batch_write_errors_name_the_record_and_write_nothing(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """`{"records": ...}` that is not a non-empty list, or holds a bad record, is a 400 in
    the API's error shape that says which record; a rejected batch writes none of them."""
    gw = await gateway(store={"path": str(tmp_path / "m.db")})
    base = f"{gw.url}/v1/memories"
    good = {"memory_type": "turn", "agent_id": "a1", "session_id": "s-batch",
            "ts": "2026-11-29T10:00:00Z",
            "user_text": "the budget is 40k", "assistant_text": "noted"}
    for records in (None, 5, "abc", {"a": 1}, []):
        status, err = await call("POST", base, {"records": records}, AUTH)
        assert status == 400, records
        assert err["error"]["code"] == "invalid_record"
        assert err["error"]["message"] == "records: must be a non-empty list of record objects"
    status, err = await call("POST", base, {"records": [good, {**good, "ts": "yesterday"}]},
                             AUTH)
    assert status == 400 and err["error"]["message"].startswith("records[1]: ts")
    status, err = await call("POST", base, {"records": [good, "x"]}, AUTH)
    assert status == 400 and err["error"]["message"] == "records[1]: body must be a JSON object"
    search = {"filter": {"session_id": "s-batch"}, "query": "budget"}
    status, found = await call("POST", f"{base}/search", search, AUTH)
    assert status == 200 and found["results"] == []  # the good record was not written either
    status, made = await call("POST", base, {"records": [good]}, AUTH)
    assert status == 201 and len(made["records"]) == 1
    status, found = await call("POST", f"{base}/search", search, AUTH)
    assert [r["memory_id"] for r in found["results"]] == [made["records"][0]["memory_id"]]


def conversation(turns: int = 30) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."},
                                  {"role": "user", "content": "Our launch codename is BLUEHERON "
                                                              "and the budget is 40k euros."},
                                  {"role": "assistant", "content": "Noted: BLUEHERON, 40k euros."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"Filler question {t}: " + "tell me more. " * 30},
                 {"role": "assistant", "content": f"Filler answer {t}. " * 30}]
    msgs.append({"role": "user", "content": "What was the launch codename and budget again?"})
    return msgs


async def test_an_unknown_field_is_a_400_naming_it_and_the_accepted_ones(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A record with a field its kind does not have (a typo, another kind's field) is a 400
    `invalid_record` naming the field (also as `param`) and the accepted ones, alone or as
    records[i] of a batch; a batch with a key beside `records` too; nothing is written."""
    gw = await gateway(store={"path": str(tmp_path / "m.db")})
    base = f"{gw.url}/v1/memories"
    good = {"memory_type": "message", "session_id": "s-typo", "ts": "2026-11-29T10:00:00Z",
            "text": "the budget is 40k", "role": "user"}
    status, err = await call("POST", base, {**good, "tgas": ["budget"]}, AUTH)
    assert status == 400 and err["error"]["code"] == "invalid_record"
    assert err["error"]["param"] == "tgas"
    assert err["error"]["message"] == (
        "unknown field 'tgas' in a message record; accepted: memory_type, kind, memory_id, "
        "session_id, agent_id, tags, ts, text, role, message_id, turn_id")
    session = {"memory_type": "session", "session_id": "s-typo", "summary": "s",
               "start_ts": "2026-11-29T10:00:00Z", "end_ts": "2026-11-29T11:00:00Z"}
    status, err = await call("POST", base, {"records": [good, {**session, "user_text": "u"}]},
                             AUTH)
    assert status == 400 and err["error"]["param"] == "records[1].user_text"
    assert err["error"]["message"].startswith(
        "records[1]: unknown field 'user_text' in a session record; 'user_text' is a field "
        "of turn records; accepted: ")
    status, err = await call("POST", base, {"records": [good], "agent_id": "a"}, AUTH)
    assert status == 400 and err["error"]["param"] == "agent_id"
    assert "in a batch write; accepted: records" in err["error"]["message"]
    status, found = await call("POST", f"{base}/search", {
        "filter": {"session_id": "s-typo", "time_from": "2026-11-29T00:00:00Z"}}, AUTH)
    assert status == 200 and found["results"] == []
    for rec in (good, session, {**good, "memory_type": "turn", "turn_id": 3, "tags": ["t"]}):
        status, made = await call("POST", base, rec, AUTH)
        assert status == 201, made


async def test_archive_evicted_turns_once_and_recall_them(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """archive: evicted writes each dropped turn once (resending the history adds nothing);
    recall brings the turn that answers the latest question back in the note."""
    db = tmp_path / "m.db"
    budget = {"max_tokens": 1200, "max_chars": None, "max_messages": None, "max_turns": None}
    # the fill off: it would bring the turn itself back, leaving the store nothing to recall
    gw = await gateway(memory={"enable_eviction": True, "budget": budget,
                               "eviction": {"recall_share": 0.0}},
                       store={"path": str(db), "archive": "evicted",
                              "recall": {"enabled": True, "top_k": 2}})
    body = {"model": "gpt-4o-mini", "messages": conversation()}
    for _ in range(2):
        status, _ = await call("POST", f"{gw.url}/v1/chat/completions", body,
                               {**AUTH, "X-Session-Id": "s-arch"})
        assert status == 200
    ev = gw.mem_events()
    assert int(ev[0]["archived"]) > 0 and int(ev[0]["recalled_records"]) >= 1
    assert int(ev[1]["archived"]) == 0  # resent: the session's turns are archived already
    sent = orjson.loads(upstream.received[-1]["raw"])["messages"]
    note = next(m["content"] for m in sent if m["content"].startswith("[memgate memory]"))
    assert "BLUEHERON" in note and "40k euros" in note
    assert sent[1]["content"] != body["messages"][1]["content"]  # the turn itself was evicted
    await gw.server.close()  # shutdown flushes the write-behind queue
    store = SqliteStore(str(db))
    await store.open()
    tenant = tenant_of(AUTH, TenantRules())
    assert tenant is not None
    rows = await store.search(Filter(tenant=tenant, agent_id=None, session_id="s-arch",
                                     time_from=0, time_to=1 << 62, boundary="closed", top_k=100))
    await store.close()
    assert len(rows) == int(ev[0]["archived"])  # the second request archived nothing new
    assert gw.state.memory.written == len(rows)


async def test_postgres_backend_through_the_gateway(gateway: GatewayFactory) -> None:
    """With store.backend postgres the same API works against the shared database."""
    async with pg_schema() as (schema, conn):
        dsn = f"{PG_DSN}?options=-csearch_path%3D{schema}"
        gw = await gateway(store={"backend": "postgres"}, env={"MEMGATE_STORE_DSN": dsn})
        rec = {"memory_type": "message", "agent_id": "a", "session_id": "s1", "role": "user",
               "ts": "2026-11-29T10:00:00Z", "text": "订单汇总写到 report.csv"}
        status, made = await call("POST", f"{gw.url}/v1/memories", rec, AUTH)
        assert status == 201
        status, found = await call("POST", f"{gw.url}/v1/memories/search", {
            "filter": {"session_id": "s1", "time_from": "2026-11-29T00:00:00Z"},
            "query": "汇总"}, AUTH)
        assert [r["memory_id"] for r in found["results"]] == [made["memory_id"]]
        assert await conn.fetchval(f"SELECT count(*) FROM {schema}.memgate_memories") == 1
        await gw.server.close()


@pytest.mark.slow
def test_memory_cli_round_trip(tmp_path: Path) -> None:
    """memgate memory write / search / get against the embedded store."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "g.yaml"
    cfg.write_text(f"store:\n  path: {tmp_path / 'm.db'}\n")

    def mg(*args: str) -> Any:
        res = subprocess.run([sys.executable, "-m", "gateway", "memory", "--config", str(cfg),
                              "--api-key", "k1", *args], capture_output=True, text=True,
                             cwd=root, check=False, timeout=60)
        assert res.returncode == 0, res.stderr
        return orjson.loads(res.stdout)

    made = mg("write", orjson.dumps({"memory_type": "message", "agent_id": "a",
                                     "session_id": "s1", "ts": "2026-01-02T03:04:05+01:00",
                                     "text": "预算 10 万"}).decode())
    found = mg("search", "--filter", '{"session_id": "s1", "time_from": "2026-01-01T00:00:00Z"}',
               "--query", "预算")
    assert [r["memory_id"] for r in found] == [made["memory_id"]]
    assert mg("get", made["memory_id"])["ts"] == "2026-01-02T02:04:05+00:00"
    again = subprocess.run([sys.executable, "-m", "gateway", "memory", "--config", str(cfg),
                            "--api-key", "k1", "write", orjson.dumps(
                                {"memory_id": made["memory_id"], "session_id": "s1",
                                 "ts": "2026-01-02T03:04:05Z", "text": "x"}).decode()],
                           capture_output=True, text=True, cwd=root, check=False, timeout=60)
    assert again.returncode == 2 and "exists already" in again.stderr


@pytest.mark.slow
def test_evict_offline_includes_recall(tmp_path: Path) -> None:
    """memgate evict --json goes through recall too: the dropped answer comes back in the note."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "memory:\n  enable_eviction: true\n  budget: {max_tokens: 1200, max_chars: null, "
        "max_messages: null, max_turns: null}\n  eviction: {recall_share: 0}\n"
        f"store:\n  path: {tmp_path / 'm.db'}\n  recall: {{enabled: true, top_k: 2}}\n"
        f"tokens:\n  models_file: {root / 'rules' / 'models.yaml'}\n")
    payload = tmp_path / "p.json"
    payload.write_bytes(orjson.dumps({"model": "gpt-4o-mini", "messages": conversation()}))
    res = subprocess.run([sys.executable, "-m", "gateway", "evict", str(payload), "--config",
                          str(cfg), "--json"], capture_output=True, text=True, cwd=root,
                         check=False, timeout=60)
    assert res.returncode == 0, res.stderr
    msgs = orjson.loads(res.stdout)["messages"]
    assert any("recalled: Our launch codename is BLUEHERON" in m["content"] for m in msgs)


@contextlib.asynccontextmanager
async def memory_gateway(gateway: GatewayFactory, backend: str, tmp_path: Path,
                         memory: dict[str, Any] | None = None,
                         **store: Any) -> AsyncIterator[str]:
    """A gateway whose store is a SQLite file or a throwaway PostgreSQL schema; yields the
    /v1/memories URL."""
    async with contextlib.AsyncExitStack() as stack:
        if backend == "sqlite":
            gw = await gateway(memory, store={"path": str(tmp_path / "m.db"), **store})
        else:
            schema, _ = await stack.enter_async_context(pg_schema())
            dsn = f"{PG_DSN}?options=-csearch_path%3D{schema}"
            gw = await gateway(memory, store={"backend": "postgres", **store},
                               env={"MEMGATE_STORE_DSN": dsn})
        stack.push_async_callback(gw.server.close)  # before the schema is dropped
        yield f"{gw.url}/v1/memories"


BACKENDS = pytest.mark.parametrize("backend", ["sqlite", "postgres"])
# seed 003's minimal write, as the seed lists it (placeholders filled in)
SEED_WRITE = {"agent_id": "agent-1", "session_id": "session-A", "turn_id": "t-2", "role": "user",
              "text": "预算 10 万，不排除取消订单", "ts": "2026-11-29T10:00:00+08:00",
              "tags": ["budget"], "memory_type": "turn"}


@BACKENDS
async def test_seed_turn_written_as_one_message_reads_back_as_written(
    gateway: GatewayFactory, tmp_path: Path, backend: str
) -> None:
    """Seed 003's minimal write (a turn as role + text) is stored and read back as role +
    text; the seed's read-back assertions hold; the two-sided turn still works."""
    async with memory_gateway(gateway, backend, tmp_path) as base:
        status, made = await call("POST", base, SEED_WRITE, AUTH)
        assert status == 201, made
        status, got = await call("GET", f"{base}/{made['memory_id']}", headers=AUTH)
        assert status == 200
        assert {k: got[k] for k in ("memory_type", "role", "text", "turn_id", "session_id",
                                    "agent_id", "tags")} == {
            "memory_type": "turn", "role": "user", "text": SEED_WRITE["text"], "turn_id": "t-2",
            "session_id": "session-A", "agent_id": "agent-1", "tags": ["budget"]}
        assert "user_text" not in got and "assistant_text" not in got
        assert got["ts"] == "2026-11-29T02:00:00+00:00"
        status, found = await call("POST", f"{base}/search", {
            "filter": {"agent_id": "agent-1", "session_id": "session-A",
                       "time_from": "2026-11-29T00:00:00Z", "time_to": "2026-11-30T00:00:00Z",
                       "tags": ["budget"], "memory_type": "turn"},
            "query": "预算", "top_k": 5}, AUTH)
        assert status == 200 and len(found["results"]) == 1
        hit = found["results"][0]
        assert hit["memory_id"] == made["memory_id"] and hit["text"] == SEED_WRITE["text"]
        assert set(hit) >= {"memory_id", "score", "text", "session_id", "ts", "tags"}
        pair = {**SEED_WRITE, "text": None, "role": None, "user_text": "u", "assistant_text": "a"}
        status, made = await call("POST", base, pair, AUTH)
        assert status == 201
        got = (await call("GET", f"{base}/{made['memory_id']}", headers=AUTH))[1]
        assert (got["user_text"], got["assistant_text"], got["text"]) == ("u", "a", "u\na")
        status, err = await call("POST", base, {**SEED_WRITE, "user_text": "u"}, AUTH)
        assert status == 400 and "not both" in err["error"]["message"]
        status, err = await call("POST", base, {**SEED_WRITE, "role": "boss"}, AUTH)
        assert status == 400 and err["error"]["message"].startswith("role:")


@BACKENDS
async def test_ids_are_unique_per_tenant(gateway: GatewayFactory, tmp_path: Path,
                                         backend: str) -> None:
    """An id another tenant holds is stored for this tenant too; an id this tenant holds
    already is a 409 in the API's error shape and changes nothing (a batch writes none)."""
    async with memory_gateway(gateway, backend, tmp_path) as base:
        mine = {**SEED_WRITE, "memory_id": "m-1", "text": "tenant A's plan"}
        theirs = {**SEED_WRITE, "memory_id": "m-1", "text": "tenant B's plan"}
        assert (await call("POST", base, mine, AUTH))[0] == 201
        status, made = await call("POST", base, theirs, OTHER)
        assert status == 201 and made["memory_id"] == "m-1"
        assert (await call("GET", f"{base}/m-1", headers=AUTH))[1]["text"] == "tenant A's plan"
        assert (await call("GET", f"{base}/m-1", headers=OTHER))[1]["text"] == "tenant B's plan"
        status, err = await call("POST", base, {**mine, "text": "overwritten?"}, AUTH)
        assert status == 409 and err["error"]["code"] == "memory_exists"
        assert "'m-1'" in err["error"]["message"] and err["error"]["type"] == "gateway_error"
        status, err = await call("POST", base, {"records": [{**mine, "memory_id": "m-2"}, mine]},
                                 AUTH)
        assert status == 409 and err["error"]["message"].startswith("records[1]: ")
        assert (await call("GET", f"{base}/m-2", headers=AUTH))[0] == 404  # none of the batch
        status, err = await call("POST", base, {"records": [{**mine, "memory_id": "m-3"}] * 2},
                                 AUTH)
        assert status == 409 and err["error"]["message"].startswith("records[1]: ")
        assert (await call("GET", f"{base}/m-1", headers=AUTH))[1]["text"] == "tenant A's plan"
        assert (await call("DELETE", f"{base}/m-1", headers=OTHER))[0] == 200
        assert (await call("GET", f"{base}/m-1", headers=AUTH))[1]["text"] == "tenant A's plan"
        status, found = await call("POST", f"{base}/search", {
            "filter": {"session_id": "session-A", "time_from": "2026-11-29T00:00:00Z"},
            "query": "plan"}, AUTH)
        assert [r["text"] for r in found["results"]] == ["tenant A's plan"]


async def test_default_tags_tag_writes_and_filter_searches(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """store.default_tags: every record written gets them; a search naming no tags filters
    by them; an explicit "tags": [] filters none."""
    db = str(tmp_path / "m.db")
    plain = await gateway(store={"path": db})
    base = f"{plain.url}/v1/memories"
    before = (await call("POST", base, {**SEED_WRITE, "tags": [], "text": "预算 old"}, AUTH))[1]
    await plain.server.close()
    gw = await gateway(store={"path": db, "default_tags": ["proj-x"]})
    base = f"{gw.url}/v1/memories"
    untagged = (await call("POST", base, {**SEED_WRITE, "tags": None, "text": "预算 a"}, AUTH))[1]
    tagged = (await call("POST", base, {**SEED_WRITE, "text": "预算 b"}, AUTH))[1]
    assert (await call("GET", f"{base}/{untagged['memory_id']}", headers=AUTH))[1]["tags"] == [
        "proj-x"]
    assert (await call("GET", f"{base}/{tagged['memory_id']}", headers=AUTH))[1]["tags"] == [
        "budget", "proj-x"]
    flt = {"session_id": "session-A", "time_from": "2026-11-29T00:00:00Z"}

    async def ids(f: dict[str, Any]) -> set[str]:
        status, found = await call("POST", f"{base}/search", {"filter": f, "top_k": 10}, AUTH)
        assert status == 200
        return {r["memory_id"] for r in found["results"]}

    assert await ids(flt) == {untagged["memory_id"], tagged["memory_id"]}
    assert await ids({**flt, "tags": []}) == {untagged["memory_id"], tagged["memory_id"],
                                              before["memory_id"]}
    assert await ids({**flt, "tags": ["budget"]}) == {tagged["memory_id"]}


@BACKENDS
async def test_records_past_retention_are_purged_in_batches(
    gateway: GatewayFactory, tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """store.retention: the records of every tenant whose ts is older are deleted (in
    batches: 2 here), with their tags and full-text entries; newer ones stay, and a
    retention of null deletes nothing."""
    import gateway.memory.api as memory_api

    monkeypatch.setattr(memory_api, "PURGE_BATCH", 2)
    async with contextlib.AsyncExitStack() as stack:
        store: dict[str, Any] = {"retention": "30d"}
        if backend == "sqlite":
            gw = await gateway(store={"path": str(tmp_path / "m.db"), **store})
        else:
            schema, _ = await stack.enter_async_context(pg_schema())
            gw = await gateway(store={"backend": "postgres", **store}, env={
                "MEMGATE_STORE_DSN": f"{PG_DSN}?options=-csearch_path%3D{schema}"})
        stack.push_async_callback(gw.server.close)
        base = f"{gw.url}/v1/memories"
        now = datetime.now(UTC)
        ids: dict[str, list[tuple[str, dict[str, str]]]] = {"old": [], "new": []}
        for k, (age, who) in enumerate([(40, AUTH), (400, AUTH), (31, OTHER), (45, AUTH),
                                        (90, OTHER), (29, AUTH), (0, OTHER)]):
            ts = (now - timedelta(days=age)).isoformat()
            status, made = await call("POST", base, {**SEED_WRITE, "turn_id": f"t-{k}",
                                                     "ts": ts, "text": f"预算 record {k}"}, who)
            assert status == 201
            ids["old" if age > 30 else "new"].append((made["memory_id"], who))
        memory = gw.state.memory
        assert memory is not None
        off = replace(gw.state.rules.store, retention_s=None)
        assert await memory.purge(off, gw.state.archive_health) == 0
        assert await memory.purge(gw.state.rules.store, gw.state.archive_health) == 5
        for mid, who in ids["old"]:
            assert (await call("GET", f"{base}/{mid}", headers=who))[0] == 404
        for mid, who in ids["new"]:
            assert (await call("GET", f"{base}/{mid}", headers=who))[0] == 200
        status, found = await call("POST", f"{base}/search", {
            "filter": {"session_id": "session-A", "time_from": "2020-01-01T00:00:00Z",
                       "time_to": now.isoformat(), "tags": ["budget"]}, "query": "预算"}, AUTH)
        assert status == 200 and [r["memory_id"] for r in found["results"]] == [
            mid for mid, who in ids["new"] if who is AUTH]
        assert "store_purged records=5" in gw.log.getvalue()
        if backend == "sqlite":  # nothing of a purged record is left behind
            import sqlite3

            db = sqlite3.connect(tmp_path / "m.db")
            counts = [db.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                      for t in ("memories", "memories_fts", "memory_tags")]
            db.close()
            assert counts == [2, 2, 2]


async def test_an_archiving_gateway_without_retention_says_so(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A config without store.retention (written before it existed) keeps records for
    ever — an upgrade deletes nothing — and a gateway that archives says so at start;
    with a retention it does not."""
    quiet = await gateway(store={"path": str(tmp_path / "a.db"), "archive": "evicted",
                                 "retention": "90d"})
    async with aiohttp.ClientSession() as s, s.get(f"{quiet.url}/healthz") as r:
        assert r.status == 200
    assert "store_retention_off" not in quiet.log.getvalue()
    gw = await gateway(store={"path": str(tmp_path / "m.db"), "archive": "evicted"})
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/healthz") as r:
        assert r.status == 200
    assert gw.state.rules.store.retention_s is None
    assert "store_retention_off" in gw.log.getvalue()
