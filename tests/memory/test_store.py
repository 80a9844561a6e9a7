"""The memory store, the same tests against SQLite (embedded) and PostgreSQL (scale-out)."""

from __future__ import annotations

import contextlib
import random
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config.schema import StoreRules
from gateway.memory.store import MemoryExists, Store, StoreError, build_filter, build_record
from gateway.memory.store.model import Filter, format_ts, parse_ts
from gateway.memory.store.postgres import PostgresStore
from gateway.memory.store.sqlite import SqliteStore
from tests.conftest import PG_DSN, pg_schema

RULES = StoreRules(max_chars_per_record=200)
T0 = parse_ts("2026-04-01T00:00:00Z", "t")
HOUR = 3600 * 1_000_000


@contextlib.asynccontextmanager
async def open_store(backend: str, path: Path) -> AsyncIterator[Store]:
    """An opened store of that backend: a SQLite file, or a throwaway PostgreSQL schema."""
    async with contextlib.AsyncExitStack() as stack:
        if backend == "sqlite":
            s: Store = SqliteStore(str(path))
        else:
            schema, _ = await stack.enter_async_context(pg_schema())
            s = PostgresStore(PG_DSN, search_path=schema)
        await s.open()
        try:
            yield s
        finally:
            await s.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    async with open_store(request.param, tmp_path / "mem.db") as s:
        yield s


def turn(session: str, ts: int, text: str, tags: list[str] | None = None,
         agent: str = "agent-1", tenant: str = "t-a") -> Any:
    return build_record({"memory_type": "turn", "agent_id": agent, "session_id": session,
                         "ts": format_ts(ts), "user_text": text, "assistant_text": "ok",
                         "tags": tags or []}, tenant, RULES)


def search(body: dict[str, Any], tenant: str = "t-a", rules: StoreRules = RULES) -> Filter:
    return build_filter(body, tenant, rules, now=T0 + 24 * HOUR)


async def test_write_read_back_the_seed_assertions(store: Store) -> None:
    """count <= top_k; session, time window and tags as filtered; memory_id round-trips."""
    recs = [turn("s-A", T0 + i * HOUR, f"预算讨论 第{i}次 budget", ["budget" if i % 2 else "misc"])
            for i in range(8)]
    recs.append(turn("s-B", T0 + 2 * HOUR, "预算讨论 in another session", ["budget"]))
    assert await store.write(recs) == 9
    f = search({"filter": {"session_id": "s-A", "time_from": format_ts(T0 + HOUR),
                           "time_to": format_ts(T0 + 6 * HOUR), "tags": ["budget"]},
                "query": "预算", "top_k": 2})
    got = await store.search(f)
    assert 0 < len(got) <= 2
    for rec, _ in got:
        assert rec.session_id == "s-A" and T0 + HOUR <= rec.ts < T0 + 6 * HOUR
        assert "budget" in rec.tags
        back = await store.get("t-a", rec.memory_id)
        assert back is not None and back.public() == rec.public()


async def test_same_text_two_sessions_filter_one(store: Store) -> None:
    """Seed case 1: 预算 10 万 in session-A and session-B; filter session-A -> only A."""
    await store.write([turn("session-A", T0, "预算 10 万"), turn("session-B", T0, "预算 10 万")])
    got = await store.search(search({"filter": {"session_id": "session-A"}, "query": "预算"}))
    assert [r.session_id for r, _ in got] == ["session-A"]
    cross = await store.search(search({"scope": "cross_session", "query": "预算 10 万"}))
    assert sorted(r.session_id for r, _ in cross) == ["session-A", "session-B"]


async def test_overlong_truncate_or_reject(store: Store) -> None:
    """Seed case 2: over max_chars_per_record: cut and marked, or refused (413), never half."""
    long_text = "长" * 500
    cut = turn("s", T0, long_text)
    assert cut.truncated and cut.original_chars == len(long_text) + len("\nok")
    await store.write([cut])
    back = await store.get("t-a", cut.memory_id)
    assert back is not None and back.truncated and len(back.text) == 200
    assert back.public()["truncated"] is True
    # a turn's two sides are cut together: what reads back is the text searched, within
    # the limit (each side cut to it alone read back at nearly twice the limit)
    rules = StoreRules(max_chars_per_record=50)
    both = build_record({"memory_type": "turn", "agent_id": "a", "session_id": "s",
                         "ts": format_ts(T0), "user_text": "u" * 45,
                         "assistant_text": "the quokka " + "a" * 50}, "t-a", rules)
    sides = both.fields["user_text"] + "\n" + both.fields["assistant_text"]
    assert both.truncated and len(sides) <= 50 and sides.strip() == both.text
    with pytest.raises(StoreError) as exc:
        build_record({"memory_type": "turn", "agent_id": "a", "session_id": "s",
                      "ts": format_ts(T0), "user_text": long_text},
                     "t-a", StoreRules(max_chars_per_record=200, on_overlong="reject"))
    assert exc.value.status == 413 and "200" in exc.value.message and "500" in exc.value.message


@pytest.mark.parametrize("boundary", ["closed", "half_open"])
async def test_records_exactly_on_the_boundaries(store: Store, boundary: str) -> None:
    """Seed case 3: ts == time_from is in; ts == time_to is in only when closed."""
    at_from, inside, at_to = (turn("s", T0, "from"), turn("s", T0 + HOUR, "inside"),
                              turn("s", T0 + 2 * HOUR, "to"))
    await store.write([at_from, inside, at_to])
    rules = StoreRules(time_boundary=boundary)  # type: ignore[arg-type]
    f = search({"filter": {"session_id": "s", "time_from": format_ts(T0),
                           "time_to": format_ts(T0 + 2 * HOUR)}, "top_k": 10}, rules=rules)
    got = {r.text.split("\n")[0] for r, _ in await store.search(f)}
    assert got == ({"from", "inside", "to"} if boundary == "closed" else {"from", "inside"})


def test_bad_requests_are_refused_precisely() -> None:
    """A naive timestamp, an implicit cross-session search, a reversed range: clear errors."""
    with pytest.raises(StoreError, match="without a timezone"):
        build_record({"memory_type": "message", "agent_id": "a", "session_id": "s",
                      "ts": "2026-04-01T00:00:00", "text": "x"}, "t", RULES)
    with pytest.raises(StoreError, match="cross-session search must be asked for explicitly"):
        build_filter({"query": "x"}, "t", RULES)
    with pytest.raises(StoreError, match="earlier than"):
        build_filter({"filter": {"session_id": "s", "time_from": "2026-04-02T00:00:00Z",
                                 "time_to": "2026-04-01T00:00:00Z"}}, "t", RULES)


async def test_one_tenants_records_never_reorder_anothers_results(store: Store) -> None:
    """A tenant's results are ordered by its own records alone: another tenant storing
    records with one of the query's words (FTS5's statistics count every tenant's rows)
    never flips them, so the order tells nothing about what others hold."""
    mine = [turn("s", T0, "note control filler"), turn("s", T0 + HOUR, "note zebra7731 filler")]
    await store.write(mine)
    query = {"filter": {"session_id": "s"}, "query": "zebra7731 control", "top_k": 1}
    before = [(r.memory_id, score) for r, score in await store.search(search(query))]
    await store.write([turn("s", T0 - HOUR, f"the vault code is zebra7731 entry {i}",
                            tenant="t-b") for i in range(6)])
    after = [(r.memory_id, score) for r, score in await store.search(search(query))]
    assert before == after and len(after) == 1
    assert after[0][0] == mine[1].memory_id  # the tie goes to the newer
    # nor which of them come back: the best match among many weaker ones stays first
    # however common another tenant makes its words
    best = turn("s2", T0, "alpha beta")
    await store.write([best, *(turn("s2", T0 + i, f"zeta note {i}") for i in range(40))])
    query = {"filter": {"session_id": "s2"}, "query": "alpha beta zeta", "top_k": 1}
    before = [(r.memory_id, score) for r, score in await store.search(search(query))]
    await store.write([turn("s2", T0, f"alpha beta {i}", tenant="t-b") for i in range(200)])
    after = [(r.memory_id, score) for r, score in await store.search(search(query))]
    assert before == after == [(best.memory_id, 0.6667)]


async def test_accented_words_are_found_alike_on_both_backends(store: Store) -> None:
    """A record is a result only when it holds one of the query's words as indexed:
    SQLite FTS5 folds "cafe" onto "café", PostgreSQL does not; neither answers "cafe
    resume" with the "café … résumé" record (it would score 0), both answer "café"."""
    rec = turn("s", T0, "café au lait, naïve résumé")
    await store.write([rec])
    assert await store.search(search({"filter": {"session_id": "s"},
                                      "query": "cafe resume"})) == []
    got = await store.search(search({"filter": {"session_id": "s"}, "query": "café"}))
    assert [(r.memory_id, score) for r, score in got] == [(rec.memory_id, 1.0)]


async def test_delete_and_tenant_scoped_get(store: Store) -> None:
    """Another tenant can neither read nor delete a record."""
    rec = turn("s", T0, "secret plan")
    await store.write([rec])
    assert await store.get("t-b", rec.memory_id) is None
    assert not await store.delete("t-b", rec.memory_id)
    assert await store.delete("t-a", rec.memory_id)
    assert await store.get("t-a", rec.memory_id) is None


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    """A SQLite file written by a newer memgate is refused, not silently misread."""
    import asyncio

    path = tmp_path / "future.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (99)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this memgate"):
        asyncio.run(SqliteStore(str(path)).open())


# ------------------------------------------------------------------ properties

WORDS = ["预算", "budget", "orders", "订单", "report", "路径", "cache", "plan"]


@pytest.fixture(params=["sqlite", "postgres"])
async def populated(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[
        tuple[Store, list[Any]]]:
    rnd = random.Random(3)
    recs = []
    for i in range(120):
        recs.append(turn(f"s{rnd.randint(0, 3)}", T0 + rnd.randint(0, 10) * HOUR,
                         " ".join(rnd.sample(WORDS, 3)) + f" #{i}",
                         rnd.sample(["a", "b", "c"], rnd.randint(0, 2)),
                         agent=rnd.choice(["x", "y"]), tenant=rnd.choice(["t-a", "t-b"])))
    async with open_store(request.param, tmp_path / "p.db") as s:
        await s.write(recs)
        yield s, recs


filters = st.fixed_dictionaries({
    "tenant": st.sampled_from(["t-a", "t-b"]),
    "session": st.one_of(st.none(), st.sampled_from(["s0", "s1", "s2", "s3"])),
    "agent": st.one_of(st.none(), st.sampled_from(["x", "y"])),
    "lo": st.integers(0, 10), "hi": st.integers(0, 10),
    "tags": st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True),
    "boundary": st.sampled_from(["closed", "half_open"]),
    "query": st.one_of(st.just(""), st.sampled_from(WORDS)),
    "top_k": st.integers(1, 30),
})


@given(spec=filters)
@settings(max_examples=60,  # the fixture's store is only read: sharing it is intended
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
async def test_any_filter_is_respected_and_tenants_never_mix(
    populated: tuple[Store, list[Any]], spec: dict[str, Any]
) -> None:
    """Every result satisfies the filter (tenant included); without a query the results are
    exactly the top_k most recent matching records."""
    store, recs = populated
    lo, hi = sorted((spec["lo"], spec["hi"]))
    body: dict[str, Any] = {"filter": {"session_id": spec["session"], "agent_id": spec["agent"],
                                       "time_from": format_ts(T0 + lo * HOUR),
                                       "time_to": format_ts(T0 + hi * HOUR),
                                       "tags": spec["tags"]},
                            "query": spec["query"], "top_k": spec["top_k"]}
    if spec["session"] is None:
        body["scope"] = "cross_session"
    rules = StoreRules(time_boundary=spec["boundary"])
    f = search(body, tenant=spec["tenant"], rules=rules)
    got = await store.search(f)
    assert len(got) <= spec["top_k"]
    for rec, _ in got:
        assert f.matches(rec) and rec.tenant == spec["tenant"]
        if spec["query"]:
            assert spec["query"].lower() in rec.text.lower()
    if not spec["query"]:
        expected = sorted((r for r in recs if f.matches(r)), key=lambda r: -r.ts)
        assert sorted(r.ts for r, _ in got) == sorted(r.ts for r in expected[: spec["top_k"]])


# ------------------------------------------------------------------ ids per tenant

ids_and_tenants = st.lists(st.tuples(st.sampled_from(["t-a", "t-b", "t-c"]),
                                     st.sampled_from(["m1", "m2", "m3"]),
                                     st.booleans()), min_size=1, max_size=12)


@given(writes=ids_and_tenants)
@settings(max_examples=25,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
async def test_ids_are_unique_per_tenant_property(store: Store, writes: list[Any]) -> None:
    """For any writes of colliding ids by several tenants: a write is stored or refused
    (MemoryExists, 409) and never lost; each tenant reads back exactly its first write of
    each id; an idempotent (archive) write of a held id changes nothing."""
    run = uuid.uuid4().hex  # the examples share one store: each uses its own ids
    first: dict[tuple[str, str], str] = {}
    for n, (tenant, mid, strict) in enumerate(writes):
        rec = build_record({"memory_id": f"{run}-{mid}", "session_id": "s", "ts": format_ts(T0),
                            "text": f"{tenant} {mid} #{n}"}, tenant, RULES)
        held = (tenant, mid) in first
        if strict and held:
            with pytest.raises(MemoryExists) as exc:
                await store.write([rec], exists_ok=False)
            assert exc.value.status == 409 and exc.value.index == 0
        else:
            assert await store.write([rec], exists_ok=not strict) == (0 if held else 1)
            first.setdefault((tenant, mid), rec.text)
    for (tenant, mid), text in first.items():
        back = await store.get(tenant, f"{run}-{mid}")
        assert back is not None and back.text == text and back.tenant == tenant


V1_ROW = ("m-1", "t-a", "agent", "turn", "s", T0, None, "预算 10 万", '["budget"]',
          '{"turn_id": "1", "user_text": "预算 10 万", "assistant_text": ""}', 0, None)


def test_sqlite_v1_file_is_upgraded_in_place(tmp_path: Path) -> None:
    """A store written by schema 1 (ids unique store-wide) opens as schema 2: its records,
    tags and full-text index are kept, and another tenant may now use the same id."""
    import asyncio

    from gateway.measure.terms import index_text
    from gateway.memory.store.sqlite import MIGRATIONS as SQLITE_V

    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    for stmt in SQLITE_V[1]:
        db.execute(stmt)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    db.execute("INSERT INTO schema_version VALUES (1)")
    cur = db.execute("INSERT INTO memories (memory_id, tenant, agent_id, memory_type, session_id, "
                     "ts, ts_end, text, tags, fields, truncated, original_chars) "
                     "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", V1_ROW)
    db.execute("INSERT INTO memories_fts (rowid, body) VALUES (?, ?)",
               (cur.lastrowid, index_text(V1_ROW[7])))
    db.execute("INSERT INTO memory_tags VALUES ('m-1', 't-a', 'budget')")
    db.commit()
    db.close()

    async def check() -> None:
        s = SqliteStore(str(path))
        await s.open()
        try:
            await upgraded_store_behaves(s)
        finally:
            await s.close()

    asyncio.run(check())
    assert sqlite3.connect(path).execute("SELECT version FROM schema_version").fetchone() == (2,)


async def upgraded_store_behaves(s: Store) -> None:
    old = await s.get("t-a", "m-1")
    assert old is not None and old.text == "预算 10 万" and old.tags == ["budget"]
    f = search({"filter": {"session_id": "s", "time_from": format_ts(T0), "tags": ["budget"]},
                "query": "预算"})
    assert [r.memory_id for r, _ in await s.search(f)] == ["m-1"]
    other = build_record({"memory_id": "m-1", "session_id": "s", "ts": format_ts(T0),
                          "text": "预算 of t-b", "tags": ["budget"]}, "t-b", RULES)
    assert await s.write([other], exists_ok=False) == 1
    assert [r.text for r, _ in await s.search(f)] == ["预算 10 万"]  # t-a's search: its own
    assert await s.delete("t-b", "m-1") and await s.get("t-a", "m-1") is not None


async def test_postgres_v1_table_is_upgraded_in_place() -> None:
    """The same for a PostgreSQL table created by schema 1."""
    from gateway.measure.terms import index_text
    from gateway.memory.store.postgres import MIGRATIONS as PG_V

    async with pg_schema() as (schema, conn):
        await conn.execute(f"SET search_path TO {schema}")
        for stmt in PG_V[1]:
            await conn.execute(stmt)
        await conn.execute("CREATE TABLE memgate_schema (version integer NOT NULL)")
        await conn.execute("INSERT INTO memgate_schema VALUES (1)")
        await conn.execute(
            "INSERT INTO memgate_memories (memory_id, tenant, agent_id, memory_type, session_id, "
            "ts, ts_end, text, tags, fields, truncated, original_chars, fts) VALUES "
            "($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12, to_tsvector('simple', $13))",
            *V1_ROW[:8], ["budget"], V1_ROW[9], False, None, index_text(V1_ROW[7]))
        s = PostgresStore(PG_DSN, search_path=schema)
        await s.open()
        try:
            await upgraded_store_behaves(s)
        finally:
            await s.close()
        assert await conn.fetchval("SELECT version FROM memgate_schema") == 2
