"""PostgreSQL backend (asyncpg) for replicas sharing one store: same records, same
filter semantics, `tsvector` full text over the same CJK-bigram index text.

asyncpg / socket errors are mapped here: a server that is down, refuses the login or
drops the connection is StoreUnavailable (the API's 503), its cause said without the DSN's
password; a value the server refuses is a 400. The pool reconnects by itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, unquote

import asyncpg
import orjson

from gateway.measure.terms import index_text, query_terms
from gateway.memory.store.model import (
    Filter,
    MemoryExists,
    Record,
    StoreError,
    StoreUnavailable,
    ranked,
    window,
)
from gateway.memory.store.schema import SCHEMA_VERSION

CONNECT_TIMEOUT_S = 5.0  # asyncpg's default is 60 s: a request waits on this at most
COMMAND_TIMEOUT_S = 30.0

MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE memgate_memories (
            memory_id text PRIMARY KEY,
            tenant text NOT NULL, agent_id text NOT NULL, memory_type text NOT NULL,
            session_id text NOT NULL, ts bigint NOT NULL, ts_end bigint,
            text text NOT NULL, tags text[] NOT NULL, fields jsonb NOT NULL,
            truncated boolean NOT NULL DEFAULT false, original_chars integer,
            fts tsvector NOT NULL)""",
        "CREATE INDEX memgate_memories_scope ON memgate_memories (tenant, session_id, ts)",
        "CREATE INDEX memgate_memories_time ON memgate_memories (tenant, ts)",
        "CREATE INDEX memgate_memories_fts ON memgate_memories USING gin (fts)",
        "CREATE INDEX memgate_memories_tags ON memgate_memories USING gin (tags)",
    ],
    2: [("ALTER TABLE memgate_memories DROP CONSTRAINT memgate_memories_pkey, "
         "ADD PRIMARY KEY (tenant, memory_id)")],
}
COLUMNS = ("memory_id, tenant, agent_id, memory_type, session_id, ts, ts_end, text, tags, "
           "fields, truncated, original_chars")


def dsn_parts(dsn: str) -> tuple[str, list[str]]:
    """(host[:port] to name the store by, the secrets to mask) of a DSN, read loosely so
    that a password which breaks URL parsing (a bare / # ?) is still never shown: the
    login is everything before the last "@" of the DSN, the host what follows it."""
    _, sep, rest = dsn.partition("://")
    if not sep:
        rest = dsn
    login, at, tail = rest.rpartition("@")
    host = (tail if at else rest).split("/", 1)[0].split("?", 1)[0] or "localhost"
    secrets = []
    if at and ":" in login:
        password = login.split(":", 1)[1]
        secrets += [password, unquote(password)]
    secrets += parse_qs(dsn.partition("?")[2]).get("password", [])
    return host, sorted({x for x in secrets if x}, key=len, reverse=True)


def _row(r: Any) -> Record:
    return Record(memory_id=r[0], tenant=r[1], agent_id=r[2], memory_type=r[3],
                  session_id=r[4], ts=r[5], ts_end=r[6], text=r[7], tags=list(r[8]),
                  fields=orjson.loads(r[9]), truncated=r[10], original_chars=r[11])


class PostgresStore:
    backend = "postgres"

    def __init__(self, dsn: str, search_path: str | None = None) -> None:
        self.dsn = dsn
        self.search_path = search_path
        self._pool: Any = None
        self._where, self._secrets = dsn_parts(dsn)

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        """asyncpg's and the socket's errors as the store's own (around awaits, too)."""
        try:
            yield
        except asyncpg.DataError as exc:
            raise StoreError(f"the store refused a value: {exc}") from None
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise self._unavailable(exc) from None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        cause = f"{type(exc).__name__}: {exc}"
        for secret in self._secrets:
            cause = cause.replace(secret, "***")
        return StoreUnavailable(f"the PostgreSQL store at {self._where} is unavailable: "
                                f"{cause}")

    async def open(self) -> None:
        settings = {"search_path": self.search_path} if self.search_path else None
        with self._mapped():
            try:
                pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=10,
                                                 server_settings=settings,
                                                 timeout=CONNECT_TIMEOUT_S,
                                                 command_timeout=COMMAND_TIMEOUT_S)
            except (ValueError, OverflowError, asyncpg.ClientConfigurationError) as exc:
                # a DSN asyncpg cannot read (a port that is not a number, a password with
                # a bare / # ?): unavailable (503, /readyz says why), as one that does not
                # answer is. Its text may quote any part of the DSN: only its type is said
                raise StoreUnavailable(
                    f"the PostgreSQL store at {self._where} is unavailable: its DSN cannot "
                    f"be read ({type(exc).__name__}); a password holding / # ? @ or : must "
                    "be percent-encoded") from None
        try:
            with self._mapped():
                await self._migrate(pool)
        except StoreError:
            await pool.close()
            raise
        self._pool = pool

    async def _migrate(self, pool: Any) -> None:
        async with pool.acquire() as c, c.transaction():
            await c.execute("SELECT pg_advisory_xact_lock(727272)")  # one migrator at a time
            await c.execute("CREATE TABLE IF NOT EXISTS memgate_schema (version integer NOT NULL)")
            version = await c.fetchval("SELECT version FROM memgate_schema") or 0
            if version > SCHEMA_VERSION:
                raise StoreUnavailable(f"schema version {version} is newer than this memgate "
                                       f"understands ({SCHEMA_VERSION}); upgrade memgate")
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for stmt in MIGRATIONS[v]:
                    await c.execute(stmt)
            if version == 0:
                await c.execute("INSERT INTO memgate_schema VALUES ($1)", SCHEMA_VERSION)
            elif version < SCHEMA_VERSION:
                await c.execute("UPDATE memgate_schema SET version = $1", SCHEMA_VERSION)

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    async def write(self, records: list[Record], exists_ok: bool = True) -> int:
        """Insert records in one transaction. An id the tenant holds already is left as it
        is (idempotent archiving) or, unless `exists_ok`, refused: MemoryExists, none written."""
        n = 0
        with self._mapped():
            async with self._pool.acquire() as c, c.transaction():
                for i, r in enumerate(records):
                    status = await c.execute(
                        f"INSERT INTO memgate_memories ({COLUMNS}, fts) VALUES "
                        "($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12, to_tsvector('simple', $13)) "
                        "ON CONFLICT (tenant, memory_id) DO NOTHING",
                        r.memory_id, r.tenant, r.agent_id, r.memory_type, r.session_id, r.ts,
                        r.ts_end, r.text, r.tags, orjson.dumps(r.fields).decode(), r.truncated,
                        r.original_chars, index_text(r.text))
                    inserted = status.endswith(" 1")
                    if not inserted and not exists_ok:
                        raise MemoryExists(r.memory_id, i)  # the transaction rolls back
                    n += inserted
        return n

    async def get(self, tenant: str, memory_id: str) -> Record | None:
        with self._mapped():
            row = await self._pool.fetchrow(
                f"SELECT {COLUMNS} FROM memgate_memories WHERE tenant = $1 AND memory_id = $2",
                tenant, memory_id)
        return _row(row) if row else None

    async def delete(self, tenant: str, memory_id: str) -> bool:
        with self._mapped():
            status = await self._pool.execute(
                "DELETE FROM memgate_memories WHERE tenant = $1 AND memory_id = $2",
                tenant, memory_id)
        return bool(status.endswith(" 1"))

    async def purge(self, before_us: int, limit: int) -> int:
        """Delete up to `limit` records (of any tenant) whose ts is before `before_us`."""
        with self._mapped():
            status = await self._pool.execute(
                "DELETE FROM memgate_memories WHERE ctid IN (SELECT ctid FROM "
                "memgate_memories WHERE ts < $1 LIMIT $2)", before_us, limit)
        return int(status.rsplit(" ", 1)[-1])

    async def search(self, f: Filter) -> list[tuple[Record, float]]:
        args: list[Any] = [f.tenant, f.time_from, f.time_to]
        where = ["tenant = $1", "ts >= $2", "ts <= $3" if f.boundary == "closed" else "ts < $3"]

        def add(cond: str, value: Any) -> None:
            args.append(value)
            where.append(cond.replace("?", f"${len(args)}"))

        if f.agent_id is not None:
            add("agent_id = ?", f.agent_id)
        if f.session_id is not None:
            add("session_id = ?", f.session_id)
        if f.memory_type is not None:
            add("memory_type = ?", f.memory_type)
        if f.tags:
            add("tags && ?::text[]", f.tags)
        terms = query_terms(f.query)
        if terms:
            add("fts @@ to_tsquery('simple', ?)", " | ".join(f"'{t}'" for t in terms))
            q = f"${len(args)}"
            sql = (f"SELECT {COLUMNS}, ts_rank(fts, to_tsquery('simple', {q})) AS score "
                   f"FROM memgate_memories WHERE {' AND '.join(where)} "
                   f"ORDER BY score DESC, ts DESC LIMIT {window(int(f.top_k))}")
            with self._mapped():
                rows = await self._pool.fetch(sql, *args)
            return ranked([(_row(r), float(r["score"])) for r in rows], f.query, f.top_k)
        sql = (f"SELECT {COLUMNS} FROM memgate_memories WHERE {' AND '.join(where)} "
               f"ORDER BY ts DESC LIMIT {int(f.top_k)}")
        with self._mapped():
            rows = await self._pool.fetch(sql, *args)
        return [(_row(r), 0.0) for r in rows]
