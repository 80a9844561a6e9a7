"""The intercepted API routes (chat completions, messages, responses): one request's way
through the gateway.

`intercept(wire)` is the route handler: take off (the rules snapshot, request id, tenant,
span), admit, read the body, then either relay it unchanged at once (nothing a decision
could change: it is decided after the answer) or decide, recall and relay the planned
body, with the client's bytes to fall back to; it lands whichever stage answered by
accounting for the request (`proxy.accounting`), detached from a client that leaves.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.config.schema import Rules, Upstream
from gateway.decide import splice
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.decide.history import HistoryCache
from gateway.errors import GatewayError, Unauthorized
from gateway.memory.recall import GuardedStore, recall
from gateway.memory.session import tenant_of
from gateway.observe.relayed import Relayed
from gateway.proxy.accounting import Measured, account, measure
from gateway.proxy.appstate import STATE, GatewayState
from gateway.proxy.error_answers import error_response
from gateway.proxy.intake import admit, read_body
from gateway.proxy.retrieve_loop import Archived, relay_retrieving
from gateway.proxy.session_record import OFFLOAD_CHARS, session_of
from gateway.proxy.upstream import relay
from gateway.wire.base import Wire

if TYPE_CHECKING:  # the optional extra: imported only while tracing is on
    from gateway.observe.otel import RequestSpan

_RID = re.compile(r"[^A-Za-z0-9._-]")
# how long after a cut body has left its [mem] measuring waits before running beside the
# upstream's answer: an answer complete by then (a cache, a mock) is relayed first and
# measured after it; an LLM takes longer, and the measuring runs while the client waits
MEASURE_AFTER_S = 0.002


@dataclass
class _Flight:
    """One intercepted request as its stages fill it in: what `account` needs at the end
    whichever stage answered (forwarded, deferred, refused or cancelled)."""

    request: web.Request
    state: GatewayState
    rules: Rules  # one snapshot for the whole request
    wire: Wire
    t0: float  # moved forward by the upload's time once the body is in
    rid: str
    info: Relayed
    span: RequestSpan | None  # while tracing is on (observe.otel): ended after the [mem] line
    tenant: str | None  # None: no usable credential (and no anonymous tenant), no memory
    session: str = ""
    session_from: str = ""  # the source of session.id_from that named it
    raw: bytes | None = None
    d: Decision | None = None
    overhead_ms: float = 0.0
    deferred: bool = False  # forwarded as is: decided after the response
    measuring: Measured | None = None  # the [mem] fields, measured while upstream answers
    measure_at: asyncio.TimerHandle | None = None  # when that measuring starts
    recall_failed: bool = False

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000


def intercept(wire: Wire) -> Handler:
    """A handler that measures, plans and forwards one API's requests."""

    async def handle(request: web.Request) -> web.StreamResponse:
        f = _take_off(request, wire)
        try:
            try:
                return await _forward(f)
            except GatewayError as err:
                f.info.status = err.status
                if not f.overhead_ms:
                    f.overhead_ms = f.elapsed_ms()
                return error_response(err, wire.flavor)
        except asyncio.CancelledError:
            f.info.client_left()
            raise
        finally:
            await _land(f)

    return handle


# what an operator whose callers send no key (or a placeholder: `Bearer sk-fake`, vLLM's
# EMPTY) should know, said at the first such request: never the header's value
KEYLESS = ("a request came without a usable key (none, or a placeholder such as EMPTY or "
           "sk-fake): such callers get no memory, no session state and no history cache, "
           "so each of their requests is measured (and, with eviction on, planned) from "
           "scratch; tenants.anonymous names a tenant for them")


def _history(state: GatewayState, rules: Rules) -> HistoryCache | None:
    """The history cache, unless configured off (history_cache_mb: 0) or switched off
    (MEMGATE_SHORTCUTS_OFF=history)."""
    return None if "history" in rules.shortcuts_off else state.history_cache


def _take_off(request: web.Request, wire: Wire) -> _Flight:
    """The request's snapshot of the rules, its id, tenant and span: before any byte of
    the body is read."""
    state: GatewayState = request.app[STATE]
    rules = state.rules
    t0 = time.perf_counter()
    rid = _RID.sub("", request.headers.get("X-Request-Id", ""))[:64] or os.urandom(8).hex()
    info = Relayed()
    span = state.tracer.start(request, info, wire) if state.tracer is not None else None
    # None: no usable credential (and no anonymous tenant), so no memory at all
    info.tenant = tenant_of(request.headers, rules.tenants)  # observers key by it
    return _Flight(request, state, rules, wire, t0, rid, info, span, info.tenant)


async def _forward(f: _Flight) -> web.StreamResponse:
    """Admit, read the body, then relay it as is (nothing could change it) or as planned."""
    rules = f.rules
    # chosen by path alone unless an upstream chooses by model (then the body is read
    # first): a refused caller's body is not even read
    up = None if rules.routes_by_model else rules.upstream_for(f.request.path, None,
                                                                f.wire.flavor)
    if up is not None:
        admit(rules, up, f.request)
    f.raw = await _read_timed(f)
    if up is not None and _unchangeable(f.state, rules, f.wire, f.raw, f.tenant):
        _say_keyless(f)
        return await _relay_unchanged(f, up, f.raw)
    d, up = await _plan(f, f.raw, up)  # admits the caller when the model picks the upstream
    _say_keyless(f)
    return await _relay_planned(f, up, d)


def _say_keyless(f: _Flight) -> None:
    """The first admitted request without a tenant says what that costs (once per process:
    each worker of `--workers N` says it once; a refused one is no such caller)."""
    if f.tenant is None and not f.state.keyless_seen:
        f.state.keyless_seen = True
        f.state.log.warning("keyless_callers", detail=KEYLESS)


async def _read_timed(f: _Flight) -> bytes:
    """The body; the upload is the client's time, not the gateway's: a client sending at
    20 KB/s would otherwise show seconds of overhead_ms."""
    before_body = time.perf_counter() - f.t0
    raw = await read_body(f.request, f.rules.max_body_bytes)
    f.t0 = time.perf_counter() - before_body
    return raw


async def _relay_unchanged(f: _Flight, up: Upstream, raw: bytes) -> web.StreamResponse:
    """Nothing a decision could change: the client's bytes go upstream now, the measuring
    and the [mem] line follow the response (`_land` decides)."""
    f.deferred = True
    f.overhead_ms = f.elapsed_ms()
    return await relay(f.request, f.state.pool, up, raw, f.info,
                       f.span.upstream(f.request, up) if f.span else None,
                       credential_headers=f.rules.tenants.credential_headers,
                       stream_ends=f.wire.stream_ends, usage_wire=f.wire.name)


async def _plan(f: _Flight, raw: bytes, up: Upstream | None) -> tuple[Decision, Upstream]:
    """Decide (measure, plan, cut), route by model if the path did not, recall."""
    rules = f.rules
    d, f.session, f.session_from = await _decide(f.state, f.request, rules, f.wire, raw,
                                                 f.tenant)
    f.d = d
    if up is None:
        up = rules.upstream_for(f.request.path, d.model, f.wire.flavor)
        try:
            admit(rules, up, f.request)
        except Unauthorized:
            f.d = None  # nothing of a refused request is archived or remembered
            raise
    if (f.tenant is not None and rules.store.recall_enabled and d.mode == "on"
            and d.plan is not None):
        d, f.recall_failed = await _with_recall(f.state, rules, f.wire, d, f.tenant, f.session)
        f.d = d
    return d, up


async def _relay_planned(f: _Flight, up: Upstream, d: Decision) -> web.StreamResponse:
    """Forward the planned body; the [mem] fields are measured while the upstream answers
    (the loop would wait for them otherwise), from MEASURE_AFTER_S after the body has
    left (a task started before would run first: aiohttp writes a body in a task of its
    own); an answer relayed sooner is measured after it (`_land`), not held for it."""
    f.overhead_ms = f.elapsed_ms()

    def start_measuring() -> None:
        f.measuring = asyncio.ensure_future(measure(
            f.state, f.request, f.tenant, f.session, f.wire, d, f.rid, f.recall_failed,
            f.session_from))

    def sent() -> None:
        f.measure_at = asyncio.get_running_loop().call_later(MEASURE_AFTER_S, start_measuring)

    try:
        if d.retrieve is not None:
            return await relay_retrieving(
                f.request, f.state.pool, up, f.rules, d, f.info, _fallback_body(f.rules, d),
                sent, _archive(f), f.span.upstream(f.request, up) if f.span else None)
        return await relay(f.request, f.state.pool, up, d.forward, f.info,
                           f.span.upstream(f.request, up) if f.span else None,
                           credential_headers=f.rules.tenants.credential_headers,
                           stream_ends=f.wire.stream_ends,
                           original=_fallback_body(f.rules, d), usage_wire=f.wire.name,
                           on_sent=sent)
    finally:
        if f.measure_at is not None:  # not started yet: `_land` measures
            f.measure_at.cancel()
        if f.info.first_status and f.tenant is not None:  # before the accounting: the
            # session's next request may come while this one's line is still written
            f.state.refused.mark((f.tenant, f.session), f.rules.memory.fallback_backoff_s)


def _archive(f: _Flight) -> Archived | None:
    """The tenant's archive as the retrieval tool reads it: a record of this session,
    by its id (None: no tenant, or no store)."""
    memory, tenant, session = f.state.memory, f.tenant, f.session
    if memory is None or tenant is None:
        return None
    store = GuardedStore(functools.partial(memory.get_store, f.rules.store),
                         f.state.store_health)

    async def archived(handle: str) -> str | None:
        record = await store.get(tenant, handle, lambda: [
            r for batch in memory.unwritten.values() for r in batch])
        return record.text if record is not None and record.session_id == session else None

    return archived


async def _land(f: _Flight) -> None:
    """After the answer (or the refusal, or the client leaving): decide a deferred body,
    then account (the [mem] line, metrics, shared state), inline when that cannot wait
    on anything, else in a task the client's leaving cannot cancel."""
    if f.deferred and f.raw is not None:
        try:
            f.d, f.session, f.session_from = await _decide(f.state, f.request, f.rules,
                                                           f.wire, f.raw, f.tenant)
        except GatewayError:  # cannot happen without metadata; measured as skipped
            f.d = None
    accounting = account(f.state, f.request, f.tenant, f.session, f.wire, f.d, f.info,
                         f.overhead_ms, f.rid, f.measuring, f.recall_failed, f.session_from)
    if f.span is not None:
        accounting = f.span.after(accounting)
    if _accounts_inline(f):
        await accounting  # never yields: nothing to cancel
    else:
        await _account_detached(f.state, accounting)


def _accounts_inline(f: _Flight) -> bool:
    """Can the accounting run in the handler without waiting on anything?"""
    if f.measuring is not None:  # what is left to await is the measuring
        return f.measuring.done()
    # measured here: with shared state or a big count it awaits
    return f.state.sessions.backend == "memory" and (
        f.d is None or f.d.uncounted_chars() <= OFFLOAD_CHARS
        or "thread" in f.rules.shortcuts_off)


async def _account_detached(state: GatewayState,
                            accounting: Coroutine[Any, Any, None]) -> None:
    """A client that closes its connection right after the body cancels the handler; the
    shared-state writes, the counting of a big cold history and the [mem] line still run
    to the end."""
    task = asyncio.ensure_future(accounting)
    state.background.add(task)
    task.add_done_callback(state.background.discard)
    if state.sessions.backend == "memory":  # counting: CPU, bounded
        await asyncio.shield(task)
    # waiting on Redis would hold the client's keep-alive connection: its answer is
    # complete already, the [mem] line follows within the timeouts


def _fallback_body(rules: Rules, d: Decision) -> bytes | None:
    """The client's bytes to resend if the upstream refuses the changed body (None: the
    body goes unchanged, or memory.fallback_original is off)."""
    if not rules.memory.fallback_original or d.forward == d.raw:  # the same object: not read
        return None
    return d.raw


def _unchangeable(state: GatewayState, rules: Rules, wire: Wire, raw: bytes,
                  tenant: str | None) -> bool:
    """Can no decision change this body? Eviction is not on (off or shadow only
    measure), no upstream is chosen by model, and the body holds no gateway metadata
    (which is stripped; an escaped ASCII character could spell its key, so any \\u00XX
    escape takes the normal path too). A session's resent history was searched when it
    was first seen: only what follows it is searched again."""
    if rules.memory.mode == "on" or rules.routes_by_model or "deferred" in rules.shortcuts_off:
        return False
    history = _history(state, rules)
    start = (history.unmarked_from(raw, wire, tenant)
             if history is not None and "splice" not in rules.shortcuts_off else 0)
    return splice.unmarked(raw, start)


async def _decide(
    state: GatewayState, request: web.Request, rules: Rules, wire: Wire, raw: bytes,
    tenant: str | None,
) -> tuple[Decision, str, str]:
    """Parse and plan one body; (decision, session id, the source that named it)."""
    history = _history(state, rules)
    src = None  # the session's earlier body this one was spliced from
    try:
        if history is not None and "splice" not in rules.shortcuts_off:
            payload, src = history.loads(raw, wire, tenant)
        else:
            payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    items = wire.items(payload) if isinstance(payload, dict) else None
    session, session_from = await session_of(state, rules, request, payload, items, tenant)
    # a caller without a tenant has no session history: its requests share nothing
    d = decide(raw, payload, rules, state.tokenizers, wire, history=history,
               key=None if tenant is None else (tenant, session),
               default_model=request.match_info.get("deployment"),
               archive_in=_archive_in(state, rules, tenant), spliced=src)
    if (tenant is not None and rules.memory.fallback_original
            and state.refused.holds((tenant, session)) and d.forward != d.raw):
        d = d.unchanged("upstream_refused")  # refused lately: not tried again yet
    return d, session, session_from


def _archive_in(state: GatewayState, rules: Rules, tenant: str | None) -> str | None:
    """The tenant whose store archives compacted tool results' originals (None: none, and
    never for a caller without a tenant)."""
    on = rules.memory.mode == "on" and rules.store.archive != "off" and state.memory is not None
    return tenant if on else None


async def _with_recall(
    state: GatewayState, rules: Rules, wire: Wire, d: Decision, tenant: str, session: str
) -> tuple[Decision, bool]:
    """Plan again with the records recalled for the latest question in the note; and
    whether the store failed (recall then brings back only the turns this request drops)."""
    memory = state.memory
    assert memory is not None
    store = GuardedStore(functools.partial(memory.get_store, rules.store), state.store_health,
                         memory.pending)
    recalled = await recall(store, rules.store, tenant, session, d)
    if not recalled:
        return d, store.failed
    again = decide(d.raw, d.payload, rules, state.tokenizers, wire, recalled=recalled,
                   history=_history(state, rules), key=(tenant, session), default_model=d.model,
                   archive_in=_archive_in(state, rules, tenant), spliced=d.spliced_from)
    return again, store.failed
