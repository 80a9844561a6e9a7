"""The memory store inside the gateway: HTTP routes, write-behind archiving, recall.

`POST /v1/memories` (write), `POST /v1/memories/search`, `GET` and `DELETE
/v1/memories/{id}`. The tenant is the hash of the caller's API key — never a
field of the body — so no filter can reach another tenant's records; a caller
without a usable key is refused unless `tenants.anonymous` names its tenant.
Archiving goes through a bounded queue written by a background task: it never
blocks a request, and the queue is flushed on shutdown.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from .backends import Backend, BackendDown
from .rules import TenantRules
from .session import tenant_of
from .store import Store, StoreError, StoreRules, build_filter, build_record, make_store
from .store.model import Record


class MemoryService:
    def __init__(self, env: Mapping[str, str], log: Any) -> None:
        self.env = env
        self.log = log
        self.store: Store | None = None
        self._lock = asyncio.Lock()
        self.queue: asyncio.Queue[list[Record]] = asyncio.Queue(1024)
        self.queued = self.written = self.dropped = 0

    async def get_store(self, rules: StoreRules) -> Store:
        """The store, opened on first use (a gateway that never archives opens nothing)."""
        if self.store is None:
            async with self._lock:
                if self.store is None:
                    store = make_store(rules, self.env)
                    await store.open()
                    self.store = store
                    self.log.info("store_opened", backend=store.backend)
        return self.store

    def archive(self, records: list[Record]) -> int:
        """Queue records for the writer; never blocks (a full queue drops and counts)."""
        if not records:
            return 0
        try:
            self.queue.put_nowait(records)
        except asyncio.QueueFull:
            self.dropped += len(records)
            return 0
        self.queued += len(records)
        return len(records)

    async def run_writer(self, rules: StoreRules, health: Backend) -> None:
        while True:
            batch = await self.queue.get()
            try:
                store = await health.call("open", functools.partial(self.get_store, rules))
                self.written += await health.call("write", functools.partial(store.write, batch))
            except BackendDown:  # counted and logged once per interval by the breaker; a
                self.dropped += len(batch)  # store known to be down is not tried per batch
            finally:
                self.queue.task_done()

    async def close(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except TimeoutError:
            self.log.error("archive_flush_timeout", pending=self.queue.qsize())
        if self.store is not None:
            await self.store.close()
            self.store = None


def _error(status: int, message: str, code: str) -> web.Response:
    return web.Response(status=status, content_type="application/json", body=orjson.dumps(
        {"error": {"message": message, "type": "gateway_error", "code": code, "param": None}}))


async def _caller(request: web.Request, tenants: TenantRules) -> tuple[str, Any] | web.Response:
    tenant = tenant_of(request.headers, tenants)
    if tenant is None:
        return _error(401, "the memory API needs the caller's API key (Authorization: Bearer, "
                           "x-api-key or api-key): it decides which tenant's records you see",
                      "unauthorized")
    try:
        body = orjson.loads(await request.read()) if request.body_exists else None
    except orjson.JSONDecodeError:
        return _error(400, "the body is not valid JSON", "invalid_json")
    return tenant, body


def routes(service_of: Any, rules_of: Any, tenants_of: Any) -> list[web.RouteDef]:
    """The /v1/memories routes; `service_of(request)`, `rules_of(request)` and
    `tenants_of(request)` give the MemoryService, the current StoreRules and TenantRules."""

    async def write(request: web.Request) -> web.Response:
        got = await _caller(request, tenants_of(request))
        if isinstance(got, web.Response):
            return got
        tenant, body = got
        rules: StoreRules = rules_of(request)
        batch = isinstance(body, dict) and "records" in body
        items = body["records"] if batch else [body]
        if not isinstance(items, list) or not items:
            return _error(400, "records: must be a non-empty list of record objects",
                          "invalid_record")
        try:
            records = []
            for i, b in enumerate(items):
                try:
                    records.append(build_record(b, tenant, rules))
                except StoreError as exc:  # say which record of a batch (none is written)
                    if batch:
                        exc.message = f"records[{i}]: {exc.message}"
                    raise
            store = await service_of(request).get_store(rules)
        except StoreError as exc:
            return _error(exc.status, exc.message, "invalid_record" if exc.status != 413
                          else "record_too_large")
        await store.write(records)
        out = [{"memory_id": r.memory_id, "truncated": r.truncated} for r in records]
        return web.json_response(out[0] if "records" not in body else {"records": out},
                                 status=201)

    async def search(request: web.Request) -> web.Response:
        got = await _caller(request, tenants_of(request))
        if isinstance(got, web.Response):
            return got
        tenant, body = got
        rules = rules_of(request)
        try:
            f = build_filter(body, tenant, rules)
            store = await service_of(request).get_store(rules)
        except StoreError as exc:
            return _error(exc.status, exc.message, "invalid_filter")
        results = await store.search(f)
        return web.Response(content_type="application/json", body=orjson.dumps({"results": [
            {k: v for k, v in r.public(score).items()
             if k in ("memory_id", "score", "text", "session_id", "ts", "tags", "memory_type")}
            for r, score in results]}))

    async def get(request: web.Request) -> web.Response:
        got = await _caller(request, tenants_of(request))
        if isinstance(got, web.Response):
            return got
        tenant, _ = got
        store = await service_of(request).get_store(rules_of(request))
        rec = await store.get(tenant, request.match_info["memory_id"])
        if rec is None:
            return _error(404, "no such memory", "not_found")
        return web.Response(content_type="application/json", body=orjson.dumps(rec.public()))

    async def delete(request: web.Request) -> web.Response:
        got = await _caller(request, tenants_of(request))
        if isinstance(got, web.Response):
            return got
        tenant, _ = got
        store = await service_of(request).get_store(rules_of(request))
        if not await store.delete(tenant, request.match_info["memory_id"]):
            return _error(404, "no such memory", "not_found")
        return web.json_response({"deleted": True})

    return [
        web.post("/v1/memories", write),
        web.post("/v1/memories/search", search),
        web.get("/v1/memories/{memory_id}", get),
        web.delete("/v1/memories/{memory_id}", delete),
    ]
