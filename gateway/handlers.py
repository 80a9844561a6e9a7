"""Request handlers: thin glue of parse -> plan -> forward -> one [mem] line."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from . import splice
from .app import STATE, GatewayState
from .capture import record as capture_record
from .chat import Decision, decide
from .errors import ApiFlavor, GatewayError, PayloadTooLarge, render_error
from .recall import archive_records, recall
from .rules import Rules
from .session import session_id, tenant_of
from .state import SessionRecord, compare_cut, fingerprint, known_prefix
from .store import StoreError
from .upstream import Relayed, relay
from .wire.base import Wire
from .wire.openai_chat import OPENAI_CHAT

_RID = re.compile(r"[^A-Za-z0-9._-]")
# a history with more uncounted text than this is token-counted for the [mem] line on the
# gateway's counting thread (while the upstream answers, off the event loop)
OFFLOAD_CHARS = 65_536


def flavor_for(path: str) -> ApiFlavor:
    return "anthropic" if path.startswith("/v1/messages") else "openai"



def error_response(err: GatewayError, flavor: ApiFlavor) -> web.Response:
    return web.Response(
        status=err.status, body=render_error(err, flavor), content_type="application/json"
    )


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, or PayloadTooLarge as soon as it passes `limit`."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body is {declared} bytes; the gateway accepts at most {limit} "
            "(limits.max_body_bytes)"
        )
    if declared is not None:
        return await request.read()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"request body is over {limit} bytes, the most the gateway accepts "
                "(limits.max_body_bytes)"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "" if content is None else orjson.dumps(content).decode()


def _session(request: web.Request, header: str, payload: Any, items: list[Any] | None,
             tenant: str) -> str:
    system, first_user = "", ""
    for m in items or ():
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if not system and role in ("system", "developer"):
            system = _text(m.get("content"))
        elif role == "user":
            first_user = _text(m.get("content"))
            break
    return session_id(request.headers, header, payload if isinstance(payload, dict) else {},
                      tenant, system, first_user)


def mem_fields(
    d: Decision | None, include_indices: bool, est_tokens: int | None = None
) -> dict[str, Any]:
    """The measurement and plan part of the [mem] line."""
    if d is None:
        return {"hist_msgs": 0, "hist_chars": 0, "est_tokens": 0, "budget_tokens": None,
                "evict": "skipped", "kept": 0, "dropped": 0, "pinned": 0}
    msgs = d.messages
    turn = d.conv.n_turns if d.conv is not None else sum(
        1 for m in msgs if isinstance(m, dict) and m.get("role") == "user"
    )
    f: dict[str, Any] = {
        "turn": turn,
        "hist_msgs": len(msgs),
        "hist_chars": d.hist_chars(),
        "est_tokens": d.est_tokens() if est_tokens is None else est_tokens,
        "budget_tokens": d.budget_tokens,
    }
    p = d.plan
    if d.skip_reason is not None:
        f.update(evict="skipped", kept=len(msgs), dropped=0, pinned=0, reason=d.skip_reason)
    elif p is None:  # mode=off: measured, not planned
        f.update(evict="none", kept=len(msgs), dropped=0, pinned=0)
    elif d.mode == "on":
        f.update(evict=p.evict, kept=len(p.kept), dropped=len(p.dropped), pinned=p.pinned)
        if p.recalled:  # dropped history the fill brought back (counted in kept)
            f.update(recalled=len(p.recalled), recalled_tokens=p.recalled_tokens)
    else:
        f.update(evict="none", kept=len(msgs), dropped=0, pinned=p.pinned,
                 would_drop=len(p.dropped))
        if p.dropped:
            f["would_evict"] = p.evict
    if p is not None:
        if p.over_budget:
            f["over_budget"] = True
        if p.pinned_overflow:
            f["pinned_overflow"] = p.pinned_overflow
        if include_indices and p.dropped:
            f["kept_idx"] = ",".join(map(str, p.kept))
            f["dropped_idx"] = ",".join(f"{i}:{s}" for i, s in p.dropped)
    return f


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def intercept(wire: Wire) -> Handler:
    """A handler that measures, plans and forwards one API's requests."""

    async def handle(request: web.Request) -> web.StreamResponse:
        state: GatewayState = request.app[STATE]
        rules = state.rules  # one snapshot for the whole request
        t0 = time.perf_counter()
        rid = _RID.sub("", request.headers.get("X-Request-Id", ""))[:64] or os.urandom(8).hex()
        info = Relayed()
        d: Decision | None = None
        overhead_ms = 0.0
        tenant = tenant_of(request.headers)
        session = ""
        raw: bytes | None = None
        deferred = False
        measuring: asyncio.Future[tuple[dict[str, Any], dict[str, Any]]] | None = None
        try:
            try:
                raw = await read_body(request, rules.max_body_bytes)
                if _unchangeable(state, rules, wire, raw):
                    # nothing a decision could change: the client's bytes go upstream now,
                    # the measuring and the [mem] line follow the response
                    deferred = True
                    overhead_ms = (time.perf_counter() - t0) * 1000
                    return await relay(request, state.pool, rules.upstream_for(request.path),
                                       raw, info)
                d, session = _decide(state, request, rules, wire, raw, tenant)
                if rules.store.recall_enabled and d.mode == "on" and d.plan is not None:
                    d = await _with_recall(state, rules, wire, d, tenant, session)
                up = rules.upstream_for(request.path, d.model)
                overhead_ms = (time.perf_counter() - t0) * 1000
                # measured while the upstream answers: the loop would wait for it otherwise
                measuring = asyncio.ensure_future(
                    _measure(state, request, tenant, session, wire, d, rid))
                return await relay(request, state.pool, up, d.forward, info)
            except GatewayError as err:
                info.status = err.status
                if not overhead_ms:
                    overhead_ms = (time.perf_counter() - t0) * 1000
                return error_response(err, wire.flavor)
        except asyncio.CancelledError:
            info.stream = "client_gone"
            raise
        finally:
            if deferred and raw is not None:
                try:
                    d, session = _decide(state, request, rules, wire, raw, tenant)
                except GatewayError:  # cannot happen without metadata; measured as skipped
                    d = None
            account = _account(state, request, tenant, session, wire, d, info,
                               overhead_ms, rid, measuring)
            if measuring is not None:  # what is left to await is the measuring
                inline = measuring.done()
            else:  # measured here: with shared state or a big count it awaits
                inline = state.sessions.backend == "memory" and (
                    d is None or d.uncounted_chars() <= OFFLOAD_CHARS)
            if inline:
                await account  # never yields: nothing to cancel
            else:
                # a client that closes its connection right after the body cancels this
                # handler; the shared-state writes, the counting of a big cold history
                # and the [mem] line still run to the end
                task = asyncio.ensure_future(account)
                state.background.add(task)
                task.add_done_callback(state.background.discard)
                await asyncio.shield(task)

    return handle


def _unchangeable(state: GatewayState, rules: Rules, wire: Wire, raw: bytes) -> bool:
    """Can no decision change this body? Eviction is not on (off or shadow only
    measure), no upstream is chosen by model, and the body holds no gateway metadata
    (which is stripped; an escaped ASCII character could spell its key, so any \\u00XX
    escape takes the normal path too). A session's resent history was searched when it
    was first seen: only what follows it is searched again."""
    if rules.memory.mode == "on" or rules.routes_by_model:
        return False
    history = state.history_cache
    start = history.unmarked_from(raw, wire) if history is not None else 0
    return splice.unmarked(raw, start)


def _decide(
    state: GatewayState, request: web.Request, rules: Rules, wire: Wire, raw: bytes,
    tenant: str,
) -> tuple[Decision, str]:
    """Parse and plan one body; (decision, session id)."""
    history = state.history_cache
    src = None  # the session's earlier body this one was spliced from
    try:
        if history is not None:
            payload, src = history.loads(raw, wire)
        else:
            payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    items = wire.items(payload) if isinstance(payload, dict) else None
    session = _session(request, rules.session_header, payload, items, tenant)
    d = decide(raw, payload, rules, state.tokenizers, wire, history=history,
               key=(tenant, session))
    d.spliced_from = src
    return d, session


async def _account(
    state: GatewayState, request: web.Request, tenant: str, session: str, wire: Wire,
    d: Decision | None, info: Relayed, overhead_ms: float, rid: str,
    measuring: asyncio.Future[tuple[dict[str, Any], dict[str, Any]]] | None,
) -> None:
    try:
        if measuring is not None:  # started while the upstream answered
            measured = await measuring
        else:
            if not session:  # the body never arrived: the session is what the headers say
                session = _session(request, state.rules.session_header, None, None, tenant)
            measured = await _measure(state, request, tenant, session, wire, d, rid)
        _log_mem(state, wire, d, info, overhead_ms, rid, measured)
    except Exception as exc:  # noqa: BLE001 - accounting must never fail a request
        state.log.error("mem_log_failed", error=type(exc).__name__, detail=str(exc)[:200],
                        req=rid)


async def _with_recall(
    state: GatewayState, rules: Rules, wire: Wire, d: Decision, tenant: str, session: str
) -> Decision:
    """Plan again with the records recalled for the latest question in the note."""
    assert state.memory is not None
    try:
        store = await state.memory.get_store(rules.store)
    except (StoreError, OSError) as exc:  # recall degrades to this request's dropped turns
        state.log.error("recall_store_unavailable", error=str(exc)[:200])
        store = None
    recalled = await recall(store, rules.store, tenant, session, d)
    if not recalled:
        return d
    again = decide(d.raw, d.payload, rules, state.tokenizers, wire, recalled=recalled,
                   history=state.history_cache, key=(tenant, session))
    again.spliced_from = d.spliced_from
    return again


async def _measure(
    state: GatewayState,
    request: web.Request,
    tenant: str,
    session: str,
    wire: Wire,
    d: Decision | None,
    rid: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the [mem] line says about the request itself, before and after the fields
    about its answer (status, timings), and the bookkeeping that needs only the
    decision: session record, archive, snapshot, history cache. Started while the
    upstream answers, so a client's next request does not wait for it."""
    head: dict[str, Any] = {"session": session}
    tail: dict[str, Any] = {}
    debug = state.rules.log_level == "debug"
    if d is not None and d.conv is not None and d.messages:
        head.update(await _measure_session(state, tenant, session, d, debug))
    else:
        head.update(mem_fields(d, include_indices=debug))
    if wire is not OPENAI_CHAT:
        tail["api"] = wire.name
    if wire.approx_tokens:
        tail["tokenizer"] = "approx"
    if d is None:
        return head, tail
    if d.recalled:
        tail["recalled_records"] = len(d.recalled)
    if (d.plan is not None and d.mode == "on"
            and state.rules.store.archive != "off" and state.memory is not None):
        agent = request.headers.get("X-Agent-Id", "") or "default"
        # turns starting before `since` were archived by the session's earlier requests
        # (the history cache knows their first messages are unchanged): not built again
        entry = d.view.entry if d.view is not None else None
        since = entry.archived_upto if entry is not None else 0
        records, upto = archive_records(d, tenant, session, agent, state.rules.store, since)
        tail["archived"] = queued = state.memory.archive(records)
        if entry is not None and queued == len(records):
            entry.archived_upto = upto  # a full queue dropped them: all again next time
    if d.note is not None and d.snapshot is not None:
        tail["carried"] = d.snapshot.count
        await state.sessions.put_snapshot(tenant, session, d.snapshot.fields)
        if state.rules.memory.carry.log_skipped:
            for what, reason in d.snapshot.skipped:
                state.log.info("carry_skip", session=session, field=what, reason=reason,
                               req=rid)
    if d.cache_marker_dropped:
        tail["cache_marker_dropped"] = True
        if d.cache_marker_moved:
            tail["cache_marker"] = "moved"
    if (d.view is not None and d.view.entry is not None
            and state.history_cache is not None):  # only ever saves the next parse
        state.history_cache.remember((tenant, session), d.raw, d.payload, d.messages,
                                     d.spliced_from, scan=d.mode != "on")
    return head, tail


def _log_mem(
    state: GatewayState,
    wire: Wire,
    d: Decision | None,
    info: Relayed,
    overhead_ms: float,
    rid: str,
    measured: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """The [mem] line, the capture and the metrics: what needs the answer too."""
    head, tail = measured
    fields = {
        **head,
        "mode": d.mode if d is not None else state.rules.memory.mode,
        "model": d.model if d is not None else None,
        "status": info.status or 499,
        "upstream_ms": round(info.upstream_ms, 2),
        "overhead_ms": round(overhead_ms, 2),
        "req": rid,
        **tail,
    }
    if info.stream != "complete":
        fields["stream"] = info.stream
    state.log.info("mem", **fields)
    if d is not None:
        state.capture.offer(state.rules.capture, rid, capture_record(
            fields, wire.name, d.raw, d.payload is not None, d.forward))
    state.metrics.observe(wire.name, fields["mode"], d, info, overhead_ms / 1000,
                          fields.get("est_tokens") if d is not None and d.conv else None)


async def _measure_session(
    state: GatewayState, tenant: str, session: str, d: Decision, debug: bool
) -> dict[str, Any]:
    """[mem] fields for a parsed history, reusing the session's previous request.

    A client resends its history with new messages appended: the tokens of what
    was seen before are not summed again, and the forwarded prefix is compared
    with last time (cut=none|kept|moved, prefix_tokens).
    """
    msgs = d.messages
    prev = await state.sessions.get_record(tenant, session)
    known, known_tokens = known_prefix(prev, msgs)
    grown = prev is not None and known == prev.n_messages
    if d.uncounted_chars() > OFFLOAD_CHARS:
        await d.count_off_loop(list(range(known, len(msgs))), state.counting)
    if d.view is not None and d.view.known >= known:  # the history cache holds the prefix
        msg_tokens = d.all_message_tokens()
    else:
        msg_tokens = known_tokens + sum(d.message_tokens(i) for i in range(known, len(msgs)))
    fields = mem_fields(d, debug, est_tokens=d.overhead_tokens() + msg_tokens)
    on = d.plan is not None and d.mode == "on"
    kept = tuple(d.forwarded()) if on and d.plan is not None else tuple(range(len(msgs)))
    cut = on and d.plan is not None and bool(d.plan.dropped)
    if on:
        status, same = compare_cut(prev, grown, kept, cut)
        fields.update(cut=status, prefix_tokens=sum(d.message_tokens(i) for i in kept[:same]))
    n = len(msgs)
    await state.sessions.put_record(
        tenant, session,
        SessionRecord(
            kept=_stable(kept, d), n_messages=n, last=fingerprint(msgs[-1]), cut=cut,
            msg_tokens=msg_tokens,
            before_last=fingerprint(msgs[-2]) if n > 1 else b"",
            msg_tokens_before_last=msg_tokens - d.message_tokens(n - 1),
        ),
    )
    return fields


def _stable(forwarded: tuple[int, ...], d: Decision) -> tuple[int, ...]:
    """The forwarded items the next request is compared with: all but the recalled
    history, which the next question recalls anew (the prefix a provider's cache can
    reuse ends where it starts)."""
    if d.plan is None or not d.plan.recalled:
        return forwarded
    recalled = set(d.plan.recalled)
    return tuple(i for i in forwarded if i not in recalled)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Every other route: relayed as is, no [mem] line; a body with a Content-Length is
    streamed through, a chunked one is read (up to limits.max_body_bytes) first."""
    state: GatewayState = request.app[STATE]
    rules = state.rules
    flavor = flavor_for(request.path)
    info = Relayed()
    declared = request.content_length
    if declared is not None and declared > rules.max_body_bytes:
        return error_response(
            PayloadTooLarge(
                f"request body is {declared} bytes; the gateway accepts at most "
                f"{rules.max_body_bytes} (limits.max_body_bytes)"
            ),
            flavor,
        )
    body: Any = None
    extra = None
    if declared is not None:  # streamed through as it arrives
        extra = {"Content-Length": str(declared)}
        body = request.content if request.body_exists else None
    elif request.body_exists:
        # chunked, no declared length: read up to the limit first, so a body over it is a
        # clean 413 and the upstream never sees half a request
        try:
            body = await read_body(request, rules.max_body_bytes)
        except GatewayError as err:
            return error_response(err, flavor)
    up = rules.upstream_for(request.path, None)
    try:
        return await relay(request, state.pool, up, body, info, extra)
    except GatewayError as err:
        return error_response(err, flavor)


async def metrics(request: web.Request) -> web.Response:
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
    if not hmac.compare_digest(token.encode(), given.encode()):
        return web.json_response({"error": {"message": "missing or wrong X-Memgate-Admin-Token",
                                            "type": "gateway_error", "code": "unauthorized"}},
                                 status=401)
    session = request.match_info["session"]
    found = await state.sessions.find_snapshots(session)
    if not found:
        return web.json_response({"error": {"message": f"no snapshot for session {session!r}",
                                            "type": "gateway_error", "code": "not_found"}},
                                 status=404)
    return web.json_response({"session": session, "tenants": found},
                             dumps=lambda o: orjson.dumps(o).decode())


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    rules = request.app[STATE].rules
    ok = bool(rules.upstreams) and all(u.base_url for u in rules.upstreams)
    return web.json_response(
        {
            "status": "ready" if ok else "not_ready",
            "config": rules.source,
            "mode": rules.memory.mode,
            "upstreams": [u.name for u in rules.upstreams],
        },
        status=200 if ok else 503,
    )
