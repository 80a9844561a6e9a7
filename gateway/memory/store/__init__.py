"""Memory store: session/turn/message records with filtered recall.

SQLite (one file, no service) is the embedded default; PostgreSQL serves
replicas that share one store. Both implement the same `Store` protocol and
the same filter semantics (`Filter.matches`), and run the same tests. A backend raises
only StoreError: StoreUnavailable (503) when it cannot serve, with the cause; its driver's
own exceptions are mapped inside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.config.schema import StoreRules
from gateway.memory.store.model import (
    Filter,
    MemoryExists,
    Record,
    StoreError,
    StoreUnavailable,
    build_filter,
    build_record,
)


class Store(Protocol):
    backend: str

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def write(self, records: list[Record], exists_ok: bool = True) -> int: ...
    async def get(self, tenant: str, memory_id: str) -> Record | None: ...
    async def delete(self, tenant: str, memory_id: str) -> bool: ...
    async def search(self, f: Filter) -> list[tuple[Record, float]]: ...
    async def purge(self, before_us: int, limit: int) -> int: ...


def make_store(rules: StoreRules, env: Mapping[str, str]) -> Store:
    if rules.backend == "postgres":
        from gateway.memory.store.postgres import PostgresStore

        dsn = env.get(rules.dsn_env, "")
        if not dsn:
            raise StoreUnavailable(f"store.backend is postgres but {rules.dsn_env} is not set")
        return PostgresStore(dsn)
    from gateway.memory.store.sqlite import SqliteStore

    return SqliteStore(rules.path)


__all__ = ["Filter", "MemoryExists", "Record", "Store", "StoreError",
           "StoreUnavailable", "build_filter", "build_record", "make_store"]
