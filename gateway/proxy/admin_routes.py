"""The gateway's own routes, never relayed: the probes `/healthz` and `/readyz` (with each
backend's state and the last reload), `/metrics`, and the admin view of a session's
carry-over snapshot; with listen.admin_port they are what the admin listener serves.
"""

from __future__ import annotations

import functools
import hmac
from typing import Any

import orjson
from aiohttp import web

from gateway.memory.backends import BackendDown, iso_utc
from gateway.memory.recall import OPEN_TIMEOUT_S, RECALL_TIMEOUT_S
from gateway.memory.state import RedisState
from gateway.proxy.appstate import STATE, GatewayState


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus exposition of this gateway (all workers' with a shared directory)."""
    m = request.app[STATE].metrics
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def admin_session_memory(request: web.Request) -> web.Response:
    """The carry-over snapshot of a session (every tenant that has one).

    Needs MEMGATE_ADMIN_TOKEN in the gateway's environment and the same value in
    the X-Memgate-Admin-Token header; without a configured token the route is off.
    """
    state: GatewayState = request.app[STATE]
    env = state.reloader.env
    if request.remote not in ("127.0.0.1", "::1") and env.get("MEMGATE_ADMIN_ALLOW_REMOTE") != "1":
        return web.json_response({"error": {"message": "admin API is loopback-only (set "
                                            "MEMGATE_ADMIN_ALLOW_REMOTE=1 to open it)",
                                            "type": "gateway_error", "code": "forbidden"}},
                                 status=403)
    token = env.get("MEMGATE_ADMIN_TOKEN", "")
    given = request.headers.get("X-Memgate-Admin-Token", "")
    if not token:
        return web.json_response({"error": {"message": "admin API disabled: set "
                                            "MEMGATE_ADMIN_TOKEN", "type": "gateway_error",
                                            "code": "admin_disabled"}}, status=404)
    # a header's non-UTF-8 bytes arrive as surrogate escapes: compared as the bytes sent
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                               given.encode("utf-8", "surrogateescape")):
        return web.json_response({"error": {"message": "missing or wrong X-Memgate-Admin-Token",
                                            "type": "gateway_error", "code": "unauthorized"}},
                                 status=401)
    session = request.match_info["session"]
    try:
        found = await state.sessions.find_snapshots(session)
    except BackendDown as exc:
        return web.json_response({"error": {"message": f"session state unavailable: {exc}",
                                            "type": "gateway_error",
                                            "code": "backend_unavailable"}}, status=503)
    if not found:
        return web.json_response({"error": {"message": f"no snapshot for session {session!r}",
                                            "type": "gateway_error", "code": "not_found"}},
                                 status=404)
    return web.json_response({"session": session, "tenants": found},
                             dumps=lambda o: orjson.dumps(o).decode())


async def healthz(request: web.Request) -> web.Response:
    """Alive: answers while the process serves HTTP at all."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """503 only when the gateway cannot forward (no upstream). A backend that is down
    degrades a feature, not forwarding: the replica stays in rotation and the body says
    `degraded`, with each backend's state and the last config reload."""
    state: GatewayState = request.app[STATE]
    rules = state.rules
    ok = bool(rules.upstreams) and all(u.base_url for u in rules.upstreams)
    await _ping_store(state)
    opened = state.memory is not None and state.memory.store is not None
    backends = {"state": await _state_status(state),
                "store": {"backend": rules.store.backend, "opened": opened,
                          **state.store_health.status()},
                "archive": {"backend": rules.store.backend, **state.archive_health.status()}}
    body: dict[str, Any] = {
        "status": "not_ready" if not ok else "ready",
        "config": rules.source,
        "mode": rules.memory.mode,
        "upstreams": [u.name for u in rules.upstreams],
        "backends": backends,
    }
    last = state.reloader.last
    if last is not None:
        at, result, error = last
        body["reload"] = {"at": iso_utc(at),
                          "result": result, **({"error": error} if error else {})}
    if ok and (any(b["status"] != "ok" for b in backends.values())
               or (last is not None and last[1] == "failed")):
        body["status"] = "degraded"
    return web.json_response(body, status=200 if ok else 503)


async def _ping_store(state: GatewayState) -> None:
    """A PostgreSQL store is asked too (opened if it is not yet, then one keyed read),
    so /readyz shows a dead or unreachable server without traffic; bounded like recall
    and not tried while its breaker is open. SQLite is a file: nothing to ask."""
    memory, rules = state.memory, state.rules.store
    if memory is None or rules.backend != "postgres":
        return
    try:
        store = await state.store_health.call(
            "open", functools.partial(memory.get_store, rules), OPEN_TIMEOUT_S)
        await state.store_health.call("ping", functools.partial(store.get, "readyz", "readyz"),
                                      RECALL_TIMEOUT_S)
    except BackendDown:
        pass  # counted and shown by store_health.status()


async def _state_status(state: GatewayState) -> dict[str, Any]:
    sessions = state.sessions
    if not isinstance(sessions, RedisState):
        return {"backend": sessions.backend, "status": "ok"}
    try:  # bounded by the Redis timeouts; not tried while the breaker is open
        await sessions.ping()
    except BackendDown:
        pass
    return {"backend": sessions.backend, **sessions.health.status()}
