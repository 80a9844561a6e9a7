"""Memory store: session/turn/message records with filtered recall.

SQLite (one file, no service) is the embedded default; PostgreSQL serves
replicas that share one store. Both implement the same `Store` protocol and
the same filter semantics (`Filter.matches`), and run the same tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .model import Filter, Record, StoreError, StoreRules, build_filter, build_record


class Store(Protocol):
    backend: str

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def write(self, records: list[Record]) -> int: ...
    async def get(self, tenant: str, memory_id: str) -> Record | None: ...
    async def delete(self, tenant: str, memory_id: str) -> bool: ...
    async def search(self, f: Filter) -> list[tuple[Record, float]]: ...


def make_store(rules: StoreRules, env: Mapping[str, str]) -> Store:
    if rules.backend == "postgres":
        from .postgres import PostgresStore

        dsn = env.get(rules.dsn_env, "")
        if not dsn:
            raise StoreError(f"store.backend is postgres but {rules.dsn_env} is not set", 500)
        return PostgresStore(dsn)
    from .sqlite import SqliteStore

    return SqliteStore(rules.path)


__all__ = ["Filter", "Record", "Store", "StoreError", "StoreRules", "build_filter",
           "build_record", "make_store"]
