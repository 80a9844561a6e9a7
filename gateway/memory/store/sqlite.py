"""SQLite backend: the embedded default (one file, WAL), FTS5 BM25 for `query`.

Every sqlite3 / OS error is mapped here to StoreUnavailable (the API's 503 with the cause):
a read-only directory, a full disk or a path that cannot be created degrades the memory
routes, never into a bare 500."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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

_V2_MEMORIES = """CREATE TABLE memories_v2 (
            rowid INTEGER PRIMARY KEY,
            memory_id TEXT NOT NULL,
            tenant TEXT NOT NULL, agent_id TEXT NOT NULL, memory_type TEXT NOT NULL,
            session_id TEXT NOT NULL, ts INTEGER NOT NULL, ts_end INTEGER,
            text TEXT NOT NULL, tags TEXT NOT NULL, fields TEXT NOT NULL,
            truncated INTEGER NOT NULL DEFAULT 0, original_chars INTEGER,
            UNIQUE (tenant, memory_id))"""

MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE memories (
            rowid INTEGER PRIMARY KEY,
            memory_id TEXT UNIQUE NOT NULL,
            tenant TEXT NOT NULL, agent_id TEXT NOT NULL, memory_type TEXT NOT NULL,
            session_id TEXT NOT NULL, ts INTEGER NOT NULL, ts_end INTEGER,
            text TEXT NOT NULL, tags TEXT NOT NULL, fields TEXT NOT NULL,
            truncated INTEGER NOT NULL DEFAULT 0, original_chars INTEGER)""",
        "CREATE INDEX memories_scope ON memories (tenant, session_id, ts)",
        "CREATE INDEX memories_time ON memories (tenant, ts)",
        """CREATE TABLE memory_tags (memory_id TEXT NOT NULL, tenant TEXT NOT NULL,
            tag TEXT NOT NULL, PRIMARY KEY (memory_id, tag))""",
        "CREATE INDEX memory_tags_tag ON memory_tags (tenant, tag)",
        "CREATE VIRTUAL TABLE memories_fts USING fts5(body)",
    ],
    2: [  # SQLite cannot change a constraint: copy into tables keyed by (tenant, memory_id)
        _V2_MEMORIES,  # rowids kept: they are the full-text index's keys
        "INSERT INTO memories_v2 (rowid, {c}) SELECT rowid, {c} FROM memories",
        "DROP TABLE memories",
        "ALTER TABLE memories_v2 RENAME TO memories",
        "CREATE INDEX memories_scope ON memories (tenant, session_id, ts)",
        "CREATE INDEX memories_time ON memories (tenant, ts)",
        """CREATE TABLE memory_tags_v2 (memory_id TEXT NOT NULL, tenant TEXT NOT NULL,
            tag TEXT NOT NULL, PRIMARY KEY (tenant, memory_id, tag))""",
        "INSERT INTO memory_tags_v2 SELECT memory_id, tenant, tag FROM memory_tags",
        "DROP TABLE memory_tags",
        "ALTER TABLE memory_tags_v2 RENAME TO memory_tags",
        "CREATE INDEX memory_tags_tag ON memory_tags (tenant, tag)",
    ],
}
COLUMNS = ("memory_id, tenant, agent_id, memory_type, session_id, ts, ts_end, text, tags, "
           "fields, truncated, original_chars")
MIGRATIONS[2][1] = MIGRATIONS[2][1].format(c=COLUMNS)


def _row(r: tuple[Any, ...]) -> Record:
    return Record(memory_id=r[0], tenant=r[1], agent_id=r[2], memory_type=r[3],
                  session_id=r[4], ts=r[5], ts_end=r[6], text=r[7], tags=orjson.loads(r[8]),
                  fields=orjson.loads(r[9]), truncated=bool(r[10]), original_chars=r[11])


BUSY_TIMEOUT_S = 2.0  # how long one call waits for another writer's lock on the file


class SqliteStore:
    """One connection, used by one thread of the store's own: a call the file's lock holds
    up (a backup, another process writing) waits there, never in the event loop's default
    executor (the config reload, captures and token counting use it). A call that waited
    BUSY_TIMEOUT_S for the lock fails, and so, at once, does every call in the next
    BUSY_TIMEOUT_S: a file locked for a minute answers 503s in seconds, not a queue of
    them each waiting its turn."""

    backend = "sqlite"

    def __init__(self, path: str) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="memgate-sqlite")
        self._locked_until = 0.0  # monotonic: calls fail fast until then

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def open(self) -> None:
        await self._call(self._open)

    def _open(self) -> None:
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                 timeout=BUSY_TIMEOUT_S)
        except (sqlite3.Error, OSError) as exc:
            raise self._unavailable("cannot be opened", exc) from None
        try:
            _migrate(db, self.path)
        except (sqlite3.Error, OSError) as exc:
            db.close()
            raise self._unavailable("cannot be opened", exc) from None
        except StoreError:
            db.close()
            raise
        self._db = db

    def _unavailable(self, what: str, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"the SQLite store {self.path} {what}: "
                                f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            await self._call(db.close)
        self._thread.shutdown(wait=False)

    def _run(self, fn: Any, *args: Any) -> Any:
        assert self._db is not None, "store not opened"
        wait = self._locked_until - time.monotonic()
        if wait > 0:
            raise StoreUnavailable(f"the SQLite store {self.path} is locked by another "
                                   f"writer (tried again in {wait:.1f}s)")
        try:
            return fn(self._db, *args)  # on the store's one thread: one call at a time
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                self._locked_until = time.monotonic() + BUSY_TIMEOUT_S
            raise self._unavailable("failed", exc) from None
        except (sqlite3.Error, OSError) as exc:
            raise self._unavailable("failed", exc) from None

    async def write(self, records: list[Record], exists_ok: bool = True) -> int:
        """Insert records in one transaction. An id the tenant holds already is left as it
        is (idempotent archiving) or, unless `exists_ok`, refused: MemoryExists, none written."""
        return int(await self._call(self._run, _write, records, exists_ok))

    async def get(self, tenant: str, memory_id: str) -> Record | None:
        rec: Record | None = await self._call(self._run, _get, tenant, memory_id)
        return rec

    async def delete(self, tenant: str, memory_id: str) -> bool:
        return bool(await self._call(self._run, _delete, tenant, memory_id))

    async def search(self, f: Filter) -> list[tuple[Record, float]]:
        out: list[tuple[Record, float]] = await self._call(self._run, _search, f)
        return out

    async def purge(self, before_us: int, limit: int) -> int:
        """Delete up to `limit` records (of any tenant) whose ts is before `before_us`."""
        return int(await self._call(self._run, _purge, before_us, limit))


def _migrate(db: sqlite3.Connection, path: str) -> None:
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = db.execute("SELECT version FROM schema_version").fetchone()
    version = row[0] if row else 0
    if version > SCHEMA_VERSION:
        raise StoreUnavailable(f"{path}: schema version {version} is newer than this memgate "
                               f"understands ({SCHEMA_VERSION}); upgrade memgate")
    with db:
        db.execute("BEGIN")
        for v in range(version + 1, SCHEMA_VERSION + 1):
            for stmt in MIGRATIONS[v]:
                db.execute(stmt)
        if version == 0:
            db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
        else:
            db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))


def _write(db: sqlite3.Connection, records: list[Record], exists_ok: bool) -> int:
    n = 0
    with db:
        db.execute("BEGIN")
        for i, r in enumerate(records):
            cur = db.execute(
                f"INSERT OR IGNORE INTO memories ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (r.memory_id, r.tenant, r.agent_id, r.memory_type, r.session_id, r.ts, r.ts_end,
                 r.text, orjson.dumps(r.tags).decode(), orjson.dumps(r.fields).decode(),
                 int(r.truncated), r.original_chars))
            if not cur.rowcount and not exists_ok:
                raise MemoryExists(r.memory_id, i)  # leaves `with db`: rolled back
            if cur.rowcount:
                n += 1
                db.execute("INSERT INTO memories_fts (rowid, body) VALUES (?, ?)",
                           (cur.lastrowid, index_text(r.text)))
                db.executemany("INSERT OR IGNORE INTO memory_tags VALUES (?, ?, ?)",
                               [(r.memory_id, r.tenant, t) for t in r.tags])
    return n


def _get(db: sqlite3.Connection, tenant: str, memory_id: str) -> Record | None:
    row = db.execute(f"SELECT {COLUMNS} FROM memories WHERE tenant = ? AND memory_id = ?",
                     (tenant, memory_id)).fetchone()
    return _row(row) if row else None


def _delete(db: sqlite3.Connection, tenant: str, memory_id: str) -> int:
    with db:
        db.execute("BEGIN")
        row = db.execute("SELECT rowid FROM memories WHERE tenant = ? AND memory_id = ?",
                         (tenant, memory_id)).fetchone()
        if not row:
            return 0
        db.execute("DELETE FROM memories_fts WHERE rowid = ?", (row[0],))
        db.execute("DELETE FROM memory_tags WHERE tenant = ? AND memory_id = ?",
                   (tenant, memory_id))
        db.execute("DELETE FROM memories WHERE rowid = ?", (row[0],))
    return 1


def _purge(db: sqlite3.Connection, before_us: int, limit: int) -> int:
    with db:
        db.execute("BEGIN")
        rows = db.execute("SELECT rowid, tenant, memory_id FROM memories WHERE ts < ? LIMIT ?",
                          (before_us, limit)).fetchall()
        db.executemany("DELETE FROM memories_fts WHERE rowid = ?", [(r[0],) for r in rows])
        db.executemany("DELETE FROM memory_tags WHERE tenant = ? AND memory_id = ?",
                       [(r[1], r[2]) for r in rows])
        db.executemany("DELETE FROM memories WHERE rowid = ?", [(r[0],) for r in rows])
    return len(rows)


def _search(db: sqlite3.Connection, f: Filter) -> list[tuple[Record, float]]:
    where = ["m.tenant = ?", "m.ts >= ?", "m.ts <= ?" if f.boundary == "closed" else "m.ts < ?"]
    args: list[Any] = [f.tenant, f.time_from, f.time_to]
    if f.agent_id is not None:
        where.append("m.agent_id = ?")
        args.append(f.agent_id)
    if f.session_id is not None:
        where.append("m.session_id = ?")
        args.append(f.session_id)
    if f.memory_type is not None:
        where.append("m.memory_type = ?")
        args.append(f.memory_type)
    if f.tags:
        where.append("EXISTS (SELECT 1 FROM memory_tags t WHERE t.tenant = m.tenant AND "
                     f"t.memory_id = m.memory_id AND t.tag IN ({','.join('?' * len(f.tags))}))")
        args.extend(f.tags)
    cols = ", ".join(f"m.{c.strip()}" for c in COLUMNS.split(","))
    terms = query_terms(f.query)
    if terms:
        # candidates by how many of the query's terms each record holds, then the newest:
        # a count per record, never FTS5's BM25, whose statistics are every tenant's (one
        # tenant's writes would change which of another's records come back)
        each = " UNION ALL ".join(["SELECT rowid FROM memories_fts WHERE memories_fts MATCH ?"]
                                  * len(terms))
        sql = (f"SELECT {cols}, h.n FROM (SELECT rowid AS id, COUNT(*) AS n FROM ({each}) "
               f"GROUP BY rowid) h JOIN memories m ON m.rowid = h.id "
               f"WHERE {' AND '.join(where)} ORDER BY h.n DESC, m.ts DESC LIMIT ?")
        quoted = ['"' + t.replace('"', '""') + '"' for t in terms]
        rows = db.execute(sql, [*quoted, *args, window(f.top_k)]).fetchall()
        return ranked([(_row(r[:12]), float(r[12])) for r in rows], f.query, f.top_k)
    sql = f"SELECT {cols} FROM memories m WHERE {' AND '.join(where)} ORDER BY m.ts DESC LIMIT ?"
    return [(_row(r), 0.0) for r in db.execute(sql, [*args, f.top_k]).fetchall()]
