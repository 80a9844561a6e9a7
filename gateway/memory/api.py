"""The memory store inside the gateway: HTTP routes, write-behind archiving, recall.

`POST /v1/memories` (write), `POST /v1/memories/search`, `GET` and `DELETE
/v1/memories/{id}`. The tenant is the hash of the caller's API key — never a
field of the body — so no filter can reach another tenant's records; a caller
without a usable key is refused unless `tenants.anonymous` names its tenant.
Archiving goes through a bounded queue written by a background task: it never
blocks a request, and the queue is flushed on shutdown.

Every answer is JSON in OpenAI's error shape when it is an error: a body over
`limits.max_body_bytes` is a 413 (read through the chat path's bounded reader),
a store that cannot serve a 503 with the cause, an id the tenant holds already a 409.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.config.schema import Rules, StoreRules
from gateway.config.validate import MAX_ID_CHARS
from gateway.errors import GatewayError
from gateway.memory.backends import Backend, BackendDown
from gateway.memory.session import tenant_of
from gateway.memory.store import Store, StoreError, build_filter, build_record, make_store
from gateway.memory.store.model import (
    Filter,
    MemoryExists,
    Record,
    StoreUnavailable,
    check_id,
    format_ts,
    now_us,
    shown,
)

BodyReader = Callable[[web.Request, int], Awaitable[bytes]]
Handler = Callable[[web.Request], Awaitable[web.Response]]
# the code of a StoreError by its status; a 400 takes the route's own code
CODES = {404: "not_found", 409: "memory_exists", 413: "record_too_large",
         503: "store_unavailable"}
# (tenant, memory_id) of the records this process queued lately: a session whose parsed
# history is not cached (history_cache_mb: 0, evicted from it, another replica's) builds
# its archived turns again on every request; these are not queued again (~5 MB at most)
RECENT_IDS = 50_000
PURGE_EVERY_S = 600.0  # how often records past store.retention are deleted
PURGE_BATCH = 5000  # records deleted per transaction


class MemoryService:
    def __init__(self, env: Mapping[str, str], log: Any) -> None:
        self.env = env
        self.log = log
        self.store: Store | None = None
        self._lock = asyncio.Lock()
        self._failed_opens = 0
        self._open_failed: StoreUnavailable | None = None
        self.queue: asyncio.Queue[list[Record]] = asyncio.Queue(1024)
        self.queued = self.written = self.dropped = self.purged = 0
        self.recent: OrderedDict[tuple[str, str], None] = OrderedDict()
        # the batches queued and not yet written (by id): recall searches them beside the
        # store, so a session's next request finds a turn archived a moment ago
        self.unwritten: dict[int, list[Record]] = {}

    def pending(self, f: Filter) -> list[Record]:
        """The queued, not yet written records the filter matches (its query is not
        applied: recall ranks them by it with the store's)."""
        return [r for batch in self.unwritten.values() for r in batch if f.matches(r)]

    def fresh(self, records: list[Record]) -> list[Record]:
        """The records not queued by this process lately (archived= counts only these)."""
        return [r for r in records if (r.tenant, r.memory_id) not in self.recent]

    async def get_store(self, rules: StoreRules) -> Store:
        """The store, opened on first use (a gateway that never archives opens nothing).
        One that cannot be opened raises StoreUnavailable, also to the calls that waited
        on that open (a PostgreSQL that does not answer costs them one connect timeout
        together, not one each, queued behind the last), and is tried again by the next
        call."""
        if self.store is None:
            seen = self._failed_opens
            async with self._lock:
                if self.store is None:
                    if self._failed_opens != seen and self._open_failed is not None:
                        raise self._open_failed  # the open this call waited on failed
                    store = make_store(rules, self.env)
                    try:
                        await store.open()
                    except StoreUnavailable as exc:
                        self._failed_opens += 1
                        self._open_failed = exc
                        raise
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
        self.unwritten[id(records)] = records
        for r in records:
            self.recent[(r.tenant, r.memory_id)] = None
            self.recent.move_to_end((r.tenant, r.memory_id))
        while len(self.recent) > RECENT_IDS:
            self.recent.popitem(last=False)
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
                self.unwritten.pop(id(batch), None)
                self.queue.task_done()

    async def run_purger(self, rules: Callable[[], StoreRules], health: Backend,
                         every_s: float = PURGE_EVERY_S) -> None:
        """`purge` every `every_s` seconds, with the rules of the moment."""
        while True:
            await asyncio.sleep(every_s)
            await self.purge(rules(), health)

    async def purge(self, rules: StoreRules, health: Backend) -> int:
        """Delete the records whose ts is older than store.retention from the store, if
        this process has opened it (archiving or the API did), in batches of PURGE_BATCH,
        each its own transaction: a writer waits on one batch at most. Returns how many
        went (logged when any did)."""
        store = self.store
        if rules.retention_s is None or store is None:
            return 0
        before = now_us() - rules.retention_s * 1_000_000
        gone = 0
        try:
            while True:
                n = await health.call("purge", functools.partial(store.purge, before,
                                                                 PURGE_BATCH))
                gone += n
                if n < PURGE_BATCH:
                    break
        except BackendDown:  # counted and logged by the breaker; tried again next time
            pass
        self.purged += gone
        if gone:
            self.log.info("store_purged", records=gone, before=format_ts(before))
        return gone

    async def close(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except TimeoutError:
            self.log.error("archive_flush_timeout", pending=self.queue.qsize())
        if self.store is not None:
            await self.store.close()
            self.store = None


class InvalidJson(GatewayError):
    status = 400
    code = "invalid_json"


def _in_batch(exc: StoreError, i: int) -> StoreError:
    """The refusal of records[i] of a batch, saying which one (none of it is written)."""
    exc.message = f"records[{i}]: {exc.message}"
    if exc.param is not None:
        exc.param = f"records[{i}].{exc.param}"
    return exc


def _error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", body=orjson.dumps(
        {"error": {"message": message, "type": "gateway_error", "code": code, "param": param}}))


def routes(service_of: Callable[[web.Request], Any],
           rules_of: Callable[[web.Request], Rules],
           read_body: BodyReader) -> list[web.RouteDef]:
    """The /v1/memories routes; `service_of(request)` and `rules_of(request)` give the
    MemoryService and the live Rules, `read_body(request, limit)` reads a body bounded.
    The tenant is the caller's (a caller without a usable key is refused unless
    `tenants.anonymous` names its tenant)."""

    def answer(code: str, handler: Handler) -> Handler:
        """`handler` with the refusals it raises rendered in the API's error shape (a 400
        coded `code`); whatever else goes wrong is a shaped 500, logged."""

        async def run(request: web.Request) -> web.Response:
            if tenant_of(request.headers, rules_of(request).tenants) is None:
                return _error(401, "the memory API needs the caller's API key (Authorization: "
                                   "Bearer, x-api-key or api-key): it decides which tenant's "
                                   "records you see", "unauthorized")
            try:
                return await handler(request)
            except GatewayError as exc:  # the body's: 413 over the limit, invalid JSON
                return _error(exc.status, exc.message, exc.code)
            except StoreError as exc:
                return _error(exc.status, exc.message, CODES.get(exc.status, code), exc.param)
            except Exception as exc:  # noqa: BLE001 - never a bare text/plain 500
                service_of(request).log.error("memory_api_failed", route=request.path,
                                              error=type(exc).__name__)
                return _error(500, f"the memory API failed: {type(exc).__name__}",
                              "internal_error")

        return run

    def tenant(request: web.Request) -> str:
        t = tenant_of(request.headers, rules_of(request).tenants)
        assert t is not None  # answer() refused the caller otherwise
        return t

    async def body_of(request: web.Request) -> Any:
        if not request.body_exists:
            return None
        raw = await read_body(request, rules_of(request).max_body_bytes)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidJson("the body is not valid JSON") from None

    async def store_of(request: web.Request) -> Store:
        store: Store = await service_of(request).get_store(rules_of(request).store)
        return store

    async def write(request: web.Request) -> web.Response:
        body = await body_of(request)
        owner, rules = tenant(request), rules_of(request).store
        batch = isinstance(body, dict) and "records" in body
        if batch and (extra := [k for k in body if k != "records"]):
            raise StoreError(f"unknown field {shown(extra[0])} in a batch write; accepted: "
                             "records (each record's fields go inside it)",
                             param=extra[0][:MAX_ID_CHARS])
        items = body["records"] if batch else [body]
        if not isinstance(items, list) or not items:
            raise StoreError("records: must be a non-empty list of record objects")
        records = []
        for i, b in enumerate(items):
            try:
                records.append(build_record(b, owner, rules))
            except StoreError as exc:
                raise _in_batch(exc, i) if batch else exc from None
        try:
            await (await store_of(request)).write(records, exists_ok=False)
        except MemoryExists as exc:
            raise _in_batch(exc, exc.index) if batch else exc from None
        out = [{"memory_id": r.memory_id, "truncated": r.truncated} for r in records]
        return web.json_response({"records": out} if batch else out[0], status=201)

    async def search(request: web.Request) -> web.Response:
        body = await body_of(request)
        f = build_filter(body, tenant(request), rules_of(request).store)
        results = await (await store_of(request)).search(f)
        # every field of the record, as GET and the CLI show it, plus its score
        return web.Response(content_type="application/json", body=orjson.dumps({"results": [
            r.public(score) for r, score in results]}))

    async def get(request: web.Request) -> web.Response:
        memory_id = check_id(request.match_info["memory_id"], "memory_id")
        rec = await (await store_of(request)).get(tenant(request), memory_id)
        if rec is None:
            raise StoreError("no such memory", 404)
        return web.Response(content_type="application/json", body=orjson.dumps(rec.public()))

    async def delete(request: web.Request) -> web.Response:
        memory_id = check_id(request.match_info["memory_id"], "memory_id")
        if not await (await store_of(request)).delete(tenant(request), memory_id):
            raise StoreError("no such memory", 404)
        return web.json_response({"deleted": True})

    return [
        web.post("/v1/memories", answer("invalid_record", write)),
        web.post("/v1/memories/search", answer("invalid_filter", search)),
        # any id the store may hold, braces and control characters included
        web.get("/v1/memories/{memory_id:[^/]+}", answer("invalid_request", get)),
        web.delete("/v1/memories/{memory_id:[^/]+}", answer("invalid_request", delete)),
    ]
