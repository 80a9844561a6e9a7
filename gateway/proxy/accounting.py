"""What an intercepted request leaves behind once its body is decided, and its accounting.

`measure` works out the `[mem]` fields about the request itself and does the bookkeeping
that needs only the decision (session record, archived turns, compacted originals, carry
snapshot, history cache); the chat route starts it while the upstream answers. `account`
runs after the answer: it awaits (or runs) that measuring, rewrites it for a fallback to
the client's body, and writes the line. Neither ever fails a request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.decide.decision import Decision
from gateway.memory.backends import BackendDown
from gateway.memory.recall import archive_records
from gateway.memory.store.model import build_record, format_ts, now_us
from gateway.observe.relayed import Relayed
from gateway.proxy.appstate import GatewayState
from gateway.proxy.mem_line import log_mem, mem_fields
from gateway.proxy.session_record import (
    measure_session,
    remember_response,
    resent,
    session_of,
)
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT

# the [mem] fields before and after those about the answer, measured while it comes
Measured = asyncio.Future[tuple[dict[str, Any], dict[str, Any]]]


async def account(
    state: GatewayState, request: web.Request, tenant: str | None, session: str, wire: Wire,
    d: Decision | None, info: Relayed, overhead_ms: float, rid: str,
    measuring: Measured | None,
    recall_failed: bool = False,
    session_from: str = "",
) -> None:
    """The [mem] line, its metrics and the shared state of one request, after its answer
    (or its refusal, or the client leaving): `measuring` when it was started while the
    upstream answered, else measured here. First of all, which session a Responses
    answer belongs to, for the client's next request continuing it."""
    try:
        await remember_response(state, tenant, session, wire, info)
        if measuring is not None:  # started while the upstream answered
            measured = await measuring
        else:
            if not session:  # the body never arrived: the session is what the headers say
                session, session_from = await session_of(state, state.rules, request, None,
                                                         None, tenant)
            measured = await measure(state, request, tenant, session, wire, d, rid, recall_failed,
                                     session_from)
        if info.first_status and d is not None:
            d = d.unchanged("upstream_refused")  # what went is the client's body
            measured = await resent(state, tenant, session, d, measured)
        log_mem(state, wire, d, info, overhead_ms, rid, measured)
    except Exception as exc:  # noqa: BLE001 - accounting must never fail a request
        state.log.error("mem_log_failed", error=type(exc).__name__, detail=str(exc)[:200],
                        req=rid)


async def measure(
    state: GatewayState,
    request: web.Request,
    tenant: str | None,
    session: str,
    wire: Wire,
    d: Decision | None,
    rid: str,
    recall_failed: bool = False,
    session_from: str = "",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the [mem] line says about the request itself, before and after the fields
    about its answer (status, timings), and the bookkeeping that needs only the
    decision: session record, archive, snapshot, history cache. Started while the
    upstream answers, so a client's next request does not wait for it. A state backend
    that fails marks its fields missing (`state=unavailable`), never the line."""
    head: dict[str, Any] = {"session": session}
    # which source of session.id_from named it (in the tail: a fallback's rewrite keeps it)
    tail: dict[str, Any] = {"session_from": session_from} if session_from else {}
    debug = state.rules.log_level == "debug"
    if d is not None and d.conv is not None and d.messages:
        head.update(await measure_session(state, tenant, session, d, debug))
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
    if recall_failed:
        tail["recall"] = "failed"
    # a caller without a tenant gets no memory: nothing archived, no snapshot kept
    if (tenant is not None and d.plan is not None and d.mode == "on"
            and state.rules.store.archive != "off" and state.memory is not None):
        agent = request.headers.get("X-Agent-Id", "") or "default"
        # turns starting before `since` were archived by the session's earlier requests
        # (the history cache knows their first messages are unchanged): not built again
        entry = d.view.entry if d.view is not None else None
        since = entry.archived_upto if entry is not None else 0
        records, upto = archive_records(d, tenant, session, agent, state.rules.store, since)
        records = state.memory.fresh(records)  # archived= is what this request queued
        tail["archived"] = queued = state.memory.archive(records)
        if entry is not None and queued == len(records):
            entry.archived_upto = upto  # a full queue dropped them: all again next time
    if d.archived and d.plan is not None and state.memory is not None and tenant is not None:
        # the originals of kept compacted results, under the ids their markers name
        # (written again by later requests: the store keeps the first)
        kept, ts = frozenset(d.plan.kept), format_ts(now_us())
        agent = request.headers.get("X-Agent-Id", "") or "default"
        state.memory.archive([build_record(
            {"memory_id": aid, "memory_type": "message", "role": "tool", "text": text,
             "agent_id": agent, "session_id": session, "ts": ts, "tags": ["compacted"]},
            tenant, state.rules.store)
            for aid, (i, text) in d.archived.items() if i in kept])
    if d.note is not None and d.snapshot is not None:
        tail["carried"] = d.snapshot.count
        if tenant is not None:
            try:
                await state.sessions.put_snapshot(tenant, session, d.snapshot.fields)
            except BackendDown:  # counted and logged by the breaker
                head["state"] = "unavailable"
        if state.rules.memory.carry.log_skipped:
            for what, reason in d.snapshot.skipped:
                state.log.info("carry_skip", session=session, field=what, reason=reason,
                               req=rid)
    if d.cache_marker_dropped:
        tail["cache_marker_dropped"] = True
        if d.cache_marker_moved:
            tail["cache_marker"] = "moved"
    if (tenant is not None and d.view is not None and d.view.entry is not None
            and state.history_cache is not None  # only ever saves the next parse
            and "splice" not in state.rules.shortcuts_off):
        # eviction on cuts the session's next body: its items' spans are kept for it
        on = d.mode == "on"
        state.history_cache.remember((tenant, session), d.raw, d.payload, d.messages,
                                     d.spliced_from, scan=not on,
                                     spans=on and "spans" not in state.rules.shortcuts_off)
    return head, tail
