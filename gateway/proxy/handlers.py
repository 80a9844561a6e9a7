"""Request handlers: thin glue of parse -> plan -> forward -> one [mem] line."""

from __future__ import annotations

import asyncio
import functools
import hmac
import os
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.config.rules import Rules, Upstream
from gateway.decide import splice
from gateway.decide.chat import Decision, decide
from gateway.decide.history import HistoryCache
from gateway.errors import (
    ApiFlavor,
    BadPath,
    GatewayError,
    PayloadTooLarge,
    Unauthorized,
    render_error,
)
from gateway.memory.backends import BackendDown, iso_utc
from gateway.memory.recall import (
    OPEN_TIMEOUT_S,
    RECALL_TIMEOUT_S,
    GuardedStore,
    archive_records,
    recall,
)
from gateway.memory.session import client_refusal, session_id, tenant_of
from gateway.memory.state import (
    RedisState,
    SessionRecord,
    compare_cut,
    fingerprint,
    known_prefix,
    runs,
)
from gateway.memory.store.model import build_record, format_ts, now_us
from gateway.observe.capture import record as capture_record
from gateway.observe.metrics import route_class
from gateway.observe.relayed import Relayed
from gateway.observe.usage import log_fields as usage_log_fields
from gateway.proxy.appstate import STATE, GatewayState
from gateway.proxy.inflate import Inflater
from gateway.proxy.upstream import (
    DECODED,
    has_dot_segment,
    injected_key,
    is_websocket,
    relay,
    relay_websocket,
)
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT

if TYPE_CHECKING:  # the optional extra: imported only while tracing is on
    from gateway.observe.otel import RequestSpan

_RID = re.compile(r"[^A-Za-z0-9._-]")
# a history with more uncounted text than this is token-counted for the [mem] line on the
# gateway's counting thread (while the upstream answers, off the event loop)
OFFLOAD_CHARS = 65_536
# how long after a cut body has left its [mem] measuring waits before running beside the
# upstream's answer: an answer complete by then (a cache, a mock) is relayed first and
# measured after it; an LLM takes longer, and the measuring runs while the client waits
MEASURE_AFTER_S = 0.002


def flavor_for(request: web.BaseRequest) -> ApiFlavor:
    """The error shape the caller's SDK reads: Anthropic's on its Messages routes and for
    any request carrying `anthropic-version` (which every Anthropic SDK call sends, its
    models.list too), else OpenAI's."""
    if request.path.startswith("/v1/messages") or "anthropic-version" in request.headers:
        return "anthropic"
    return "openai"



def error_response(err: GatewayError, flavor: ApiFlavor) -> web.Response:
    return web.Response(
        status=err.status, body=render_error(err, flavor), content_type="application/json"
    )


@web.middleware
async def contained_paths(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 400 for a path with dot-segments (also as %2e%2e, ..%2f or backslashes): a
    request never leaves its upstream's base path nor slips past a route's glob."""
    if has_dot_segment(request.path):
        return error_response(BadPath("request path has '.' or '..' segments; the gateway "
                                      "does not resolve them"), flavor_for(request))
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if request.match_info.http_exception is None:  # a handler's own answer
            raise
        # no route takes it (a target that is no path: `CONNECT host:443`, `OPTIONS *`):
        # the client's error format, not aiohttp's text
        target = request.raw_path.split("?", 1)[0][:200]
        err = GatewayError(f"the gateway does not serve {request.method} {target}"
                           " (it is not a forward proxy: point base_url at it)")
        err.status, err.code = exc.status, "not_routed"
        return error_response(err, flavor_for(request))


def _too_large(limit: int, declared: int | None = None) -> PayloadTooLarge:
    if declared is not None:
        return PayloadTooLarge(f"request body is {declared} bytes; the gateway accepts at most "
                               f"{limit} (limits.max_body_bytes)")
    return PayloadTooLarge(f"request body is over {limit} bytes, the most the gateway accepts "
                           "(limits.max_body_bytes)")


async def read_body(request: web.Request, limit: int, decode: bool = True) -> bytes:
    """The whole request body, or PayloadTooLarge as soon as it passes `limit`.

    The server does not decompress bodies (create_app turns aiohttp's auto_decompress off):
    with `decode`, a gzip/deflate body is inflated here, and `limit` bounds what it
    inflates to as well as what arrived; without it, the bytes come as the client sent them.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit, declared)
    # every line of it: `Content-Encoding: gzip` sent twice is `gzip, gzip` (RFC 9110 5.3)
    codings = request.headers.getall("Content-Encoding", ()) if decode else ()
    encoding = ", ".join(codings) if codings else None
    inflate = Inflater.for_encoding(encoding, limit)
    if inflate is None and declared is not None:
        # not chunk by chunk: aiohttp's read() lifts the stream's buffer limit first, so the
        # socket is not paused and resumed on the way (1 MB: 1.3 ms p50 vs 2.0 ms)
        return await request.read()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(inflate.feed(chunk) if inflate is not None else chunk)
    if inflate is not None:
        inflate.finish()
        # what goes upstream is the decoded body: the relay sends no Content-Encoding (a
        # mark, not a clone with new headers: aiohttp's clone re-encodes every header as
        # strict UTF-8 and fails on a client's non-UTF-8 bytes, an Authorization say)
        request[DECODED] = True
    return b"".join(chunks)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    try:
        return "" if content is None else orjson.dumps(content).decode()
    except orjson.JSONEncodeError:  # nested too deep to write: such requests are skipped
        return ""


def _admit(rules: Rules, up: Upstream, request: web.Request) -> None:
    """A route whose upstream gets the gateway's own key serves allowlisted callers only:
    anyone else would spend that key."""
    if injected_key(up):
        why = client_refusal(request.headers, rules.tenants)
        if why is not None:
            raise Unauthorized(why)


def _session(request: web.Request, header: str, payload: Any, items: list[Any] | None,
             tenant: str | None) -> str:
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
    if d.conv is not None and d.conv.media_parts:  # only then: text traffic's line unchanged
        f["media"] = d.conv.media_parts
    p = d.plan
    if d.skip_reason is not None:
        f.update(evict="skipped", kept=len(msgs), dropped=0, pinned=0, reason=d.skip_reason)
    elif p is None:  # mode=off: measured, not planned
        f.update(evict="none", kept=len(msgs), dropped=0, pinned=0)
    elif d.mode == "on":
        f.update(evict=p.evict, kept=len(p.kept), dropped=len(p.dropped), pinned=p.pinned)
        if p.dropped or d.compacted:  # the estimate of what went (est_tokens: what came)
            f["est_sent_tokens"] = d.kept_tokens()
        if d.note is not None:  # the injected carry note: forwarded = kept + note
            f["note"] = 1
        if p.recalled:  # dropped history the fill brought back (counted in kept)
            f.update(recalled=len(p.recalled), recalled_tokens=p.recalled_tokens)
    else:
        f.update(evict="none", kept=len(msgs), dropped=0, pinned=p.pinned,
                 would_drop=len(p.dropped))
        if p.dropped:
            f["would_evict"] = p.evict
    if d.bad_metadata is not None:
        f.update(metadata="invalid", metadata_reason=d.bad_metadata)
    if p is not None:
        n, saved = d.compacted_kept()
        if n:  # in shadow mode: what would be compacted
            f.update(compacted=n, compacted_saved_tokens=saved)
        if p.over_budget:
            f["over_budget"] = True
        if p.pinned_overflow:
            f["pinned_overflow"] = p.pinned_overflow
        if include_indices and p.dropped:
            f["kept_idx"] = ",".join(map(str, p.kept))
            f["dropped_idx"] = ",".join(f"{i}:{s}" for i, s in p.dropped)
    return f


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Measured = asyncio.Future[tuple[dict[str, Any], dict[str, Any]]]


@dataclass
class _Flight:
    """One intercepted request as its stages fill it in: what `_account` needs at the end
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
    up = None if rules.routes_by_model else rules.upstream_for(f.request.path)
    if up is not None:
        _admit(rules, up, f.request)
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
    d, f.session = _decide(f.state, f.request, rules, f.wire, raw, f.tenant)
    f.d = d
    if up is None:
        up = rules.upstream_for(f.request.path, d.model)
        try:
            _admit(rules, up, f.request)
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

    def measure() -> None:
        f.measuring = asyncio.ensure_future(_measure(
            f.state, f.request, f.tenant, f.session, f.wire, d, f.rid, f.recall_failed))

    def sent() -> None:
        f.measure_at = asyncio.get_running_loop().call_later(MEASURE_AFTER_S, measure)

    try:
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


async def _land(f: _Flight) -> None:
    """After the answer (or the refusal, or the client leaving): decide a deferred body,
    then account (the [mem] line, metrics, shared state), inline when that cannot wait
    on anything, else in a task the client's leaving cannot cancel."""
    if f.deferred and f.raw is not None:
        try:
            f.d, f.session = _decide(f.state, f.request, f.rules, f.wire, f.raw, f.tenant)
        except GatewayError:  # cannot happen without metadata; measured as skipped
            f.d = None
    account = _account(f.state, f.request, f.tenant, f.session, f.wire, f.d, f.info,
                       f.overhead_ms, f.rid, f.measuring, f.recall_failed)
    if f.span is not None:
        account = f.span.after(account)
    if _accounts_inline(f):
        await account  # never yields: nothing to cancel
    else:
        await _account_detached(f.state, account)


def _accounts_inline(f: _Flight) -> bool:
    """Can the accounting run in the handler without waiting on anything?"""
    if f.measuring is not None:  # what is left to await is the measuring
        return f.measuring.done()
    # measured here: with shared state or a big count it awaits
    return f.state.sessions.backend == "memory" and (
        f.d is None or f.d.uncounted_chars() <= OFFLOAD_CHARS
        or "thread" in f.rules.shortcuts_off)


async def _account_detached(state: GatewayState,
                            account: Coroutine[Any, Any, None]) -> None:
    """A client that closes its connection right after the body cancels the handler; the
    shared-state writes, the counting of a big cold history and the [mem] line still run
    to the end."""
    task = asyncio.ensure_future(account)
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


def _decide(
    state: GatewayState, request: web.Request, rules: Rules, wire: Wire, raw: bytes,
    tenant: str | None,
) -> tuple[Decision, str]:
    """Parse and plan one body; (decision, session id)."""
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
    session = _session(request, rules.session_header, payload, items, tenant)
    # a caller without a tenant has no session history: its requests share nothing
    d = decide(raw, payload, rules, state.tokenizers, wire, history=history,
               key=None if tenant is None else (tenant, session),
               default_model=request.match_info.get("deployment"),
               archive_in=_archive_in(state, rules, tenant), spliced=src)
    if (tenant is not None and rules.memory.fallback_original
            and state.refused.holds((tenant, session)) and d.forward != d.raw):
        d = d.unchanged("upstream_refused")  # refused lately: not tried again yet
    return d, session


def _archive_in(state: GatewayState, rules: Rules, tenant: str | None) -> str | None:
    """The tenant whose store archives compacted tool results' originals (None: none, and
    never for a caller without a tenant)."""
    on = rules.memory.mode == "on" and rules.store.archive != "off" and state.memory is not None
    return tenant if on else None


async def _account(
    state: GatewayState, request: web.Request, tenant: str | None, session: str, wire: Wire,
    d: Decision | None, info: Relayed, overhead_ms: float, rid: str,
    measuring: asyncio.Future[tuple[dict[str, Any], dict[str, Any]]] | None,
    recall_failed: bool = False,
) -> None:
    try:
        if measuring is not None:  # started while the upstream answered
            measured = await measuring
        else:
            if not session:  # the body never arrived: the session is what the headers say
                session = _session(request, state.rules.session_header, None, None, tenant)
            measured = await _measure(state, request, tenant, session, wire, d, rid,
                                      recall_failed)
        if info.first_status and d is not None:
            d = d.unchanged("upstream_refused")  # what went is the client's body
            measured = await _resent(state, tenant, session, d, measured)
        _log_mem(state, wire, d, info, overhead_ms, rid, measured)
    except Exception as exc:  # noqa: BLE001 - accounting must never fail a request
        state.log.error("mem_log_failed", error=type(exc).__name__, detail=str(exc)[:200],
                        req=rid)


async def _with_recall(
    state: GatewayState, rules: Rules, wire: Wire, d: Decision, tenant: str, session: str
) -> tuple[Decision, bool]:
    """Plan again with the records recalled for the latest question in the note; and
    whether the store failed (recall then brings back only the turns this request drops)."""
    memory = state.memory
    assert memory is not None
    store = GuardedStore(functools.partial(memory.get_store, rules.store), state.store_health)
    recalled = await recall(store, rules.store, tenant, session, d)
    if not recalled:
        return d, store.failed
    again = decide(d.raw, d.payload, rules, state.tokenizers, wire, recalled=recalled,
                   history=_history(state, rules), key=(tenant, session), default_model=d.model,
                   archive_in=_archive_in(state, rules, tenant), spliced=d.spliced_from)
    return again, store.failed


async def _measure(
    state: GatewayState,
    request: web.Request,
    tenant: str | None,
    session: str,
    wire: Wire,
    d: Decision | None,
    rid: str,
    recall_failed: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the [mem] line says about the request itself, before and after the fields
    about its answer (status, timings), and the bookkeeping that needs only the
    decision: session record, archive, snapshot, history cache. Started while the
    upstream answers, so a client's next request does not wait for it. A state backend
    that fails marks its fields missing (`state=unavailable`), never the line."""
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
        **usage_log_fields(info.usage),  # only what the provider sent
        "req": rid,
        **tail,
    }
    if info.stream != "complete":
        fields["stream"] = info.stream
    if info.first_status:
        fields.update(fallback="original", first_status=info.first_status)
    state.log.info("mem", **fields)
    if d is not None:
        state.capture.offer(state.rules.capture, rid, lambda: capture_record(
            fields, wire.name, d.raw, d.payload is not None, d.forward))
    state.metrics.observe(wire.name, fields["mode"], d, info, overhead_ms / 1000,
                          fields.get("est_tokens") if d is not None and d.conv else None)
    if info.usage:
        state.metrics.observe_usage(wire.name, state.rules.model_info(fields["model"]).match,
                                    info.usage)
    for observe in state.observers:
        try:
            observe(fields, d, info)
        except Exception as exc:  # noqa: BLE001 - an observer never fails a request
            state.log.error("observer_failed", error=type(exc).__name__,
                            detail=str(exc)[:200], req=rid)


async def _measure_session(
    state: GatewayState, tenant: str | None, session: str, d: Decision, debug: bool
) -> dict[str, Any]:
    """[mem] fields for a parsed history, reusing the session's previous request.

    A client resends its history with new messages appended, or with its last message
    replaced (a retry, an edited question): the tokens of what was seen before are not
    summed again, and the forwarded prefix is compared with last time up to there
    (cut=none|kept|moved, prefix_tokens).
    """
    msgs = d.messages
    state_ok = True
    prev = None
    if tenant is not None:  # without a tenant the session is nobody's: no record is kept
        try:
            prev = await state.sessions.get_record(tenant, session)
        except BackendDown:  # measured as a first request; what needs the record is unknown
            state_ok = False
    known, known_tokens = known_prefix(prev, msgs)
    if d.uncounted_chars() > OFFLOAD_CHARS and "thread" not in state.rules.shortcuts_off:
        await d.count_off_loop(list(range(known, len(msgs))), state.counting)
    if d.view is not None and d.view.known >= known:  # the history cache holds the prefix
        msg_tokens = d.all_message_tokens()
    else:
        msg_tokens = known_tokens + sum(d.message_tokens(i) for i in range(known, len(msgs)))
    fields = mem_fields(d, debug, est_tokens=d.overhead_tokens() + msg_tokens)
    on = d.plan is not None and d.mode == "on"
    # the forwarded items the next request is compared with (all but recalled history)
    kept: Sequence[int] = _stable(d.forwarded(), d) if on else range(len(msgs))
    cut = on and d.plan is not None and bool(d.plan.dropped)
    if on and state_ok:
        status, same = compare_cut(prev, known, kept, cut)
        fields.update(cut=status, prefix_tokens=sum(d.message_tokens(i) for i in kept[:same]))
    elif on:
        fields["cut"] = "unknown"
    if tenant is None:
        return fields
    try:
        await state.sessions.put_record(tenant, session, _record(d, kept, cut, msg_tokens))
    except BackendDown:
        state_ok = False
    if not state_ok:
        fields["state"] = "unavailable"
    return fields


def _record(d: Decision, kept: Sequence[int], cut: bool, msg_tokens: int) -> SessionRecord:
    """What the session's next request is compared with: this one as forwarded (`kept`:
    its stable items)."""
    msgs = d.messages
    n = len(msgs)
    return SessionRecord(
        kept=runs(kept), n_messages=n, last=fingerprint(msgs[-1]), cut=cut,
        msg_tokens=msg_tokens, before_last=fingerprint(msgs[-2]) if n > 1 else b"",
        msg_tokens_before_last=msg_tokens - d.message_tokens(n - 1),
    )


async def _resent(
    state: GatewayState, tenant: str | None, session: str, d: Decision,
    measured: tuple[dict[str, Any], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The upstream refused the changed body and got the client's (`d`, unchanged now):
    the line, the metrics and the session record say what went, and the session's next
    requests go unchanged for memory.fallback_backoff_s (`_relay_planned` marks it). The
    cut= comparison and what described the refused body only (the records recalled into
    it, its cache marker) are left out; what was done for it stays said (turns
    archived: the conversation holds them either way; the carry snapshot)."""
    head, tail = measured
    was = head
    head = {"session": was["session"],
            **mem_fields(d, state.rules.log_level == "debug", est_tokens=was["est_tokens"])}
    if "state" in was:
        head["state"] = was["state"]
    for key in ("recalled_records", "cache_marker_dropped", "cache_marker"):
        tail.pop(key, None)
    if tenant is None or not d.messages:
        return head, tail
    n = len(d.messages)
    try:
        await state.sessions.put_record(tenant, session, _record(
            d, range(n), False, was["est_tokens"] - d.overhead_tokens()))
    except BackendDown:
        head["state"] = "unavailable"
    return head, tail


def _stable(forwarded: list[int], d: Decision) -> Sequence[int]:
    """The forwarded items the next request is compared with: all but the recalled
    history, which the next question recalls anew (the prefix a provider's cache can
    reuse ends where it starts)."""
    if d.plan is None or not d.plan.recalled:
        return forwarded
    recalled = set(d.plan.recalled)
    return tuple(i for i in forwarded if i not in recalled)


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Every other route: relayed as is, no [mem] line but a short `relay` line and
    memgate_relayed_total (by route class, never the raw path); an HTTP span while
    tracing is on."""
    state: GatewayState = request.app[STATE]
    t0 = time.perf_counter()
    info = Relayed()
    span = state.tracer.start(request, info, None) if state.tracer is not None else None
    status = 499  # the client left before its answer
    try:
        resp = await _relay_as_is(request, state, info, span)
        status = info.status or resp.status
        return resp
    finally:
        if span is not None:
            span.close(status)
        route = route_class(request.path)
        state.metrics.observe_relayed(route, status)
        state.log.info("relay", method=request.method, route=route, path=request.path[:200],
                       status=status, upstream_ms=round(info.upstream_ms, 2),
                       bytes=info.bytes_out, ms=round((time.perf_counter() - t0) * 1000, 2))


async def _relay_as_is(request: web.Request, state: GatewayState, info: Relayed,
                       span: RequestSpan | None) -> web.StreamResponse:
    """A body with a Content-Length is streamed through, whatever its size (never held:
    a file upload is the provider's to bound, OpenAI's up to 512 MB); a chunked one is
    read (up to limits.max_body_bytes) first."""
    rules = state.rules
    flavor = flavor_for(request)
    up = rules.upstream_for(request.path, None, "anthropic-version" in request.headers)
    try:
        _admit(rules, up, request)
    except Unauthorized as err:
        return error_response(err, flavor)
    if is_websocket(request):  # the Realtime API's connect(): relayed message by message
        try:
            return await relay_websocket(request, state.pool, up, info,
                                         rules.tenants.credential_headers)
        except GatewayError as err:
            return error_response(err, flavor)
    declared = request.content_length
    body: Any = None
    extra = None
    if declared is not None:  # streamed through as it arrives
        extra = {"Content-Length": str(declared)}
        body = request.content if request.body_exists else None
    elif request.body_exists:
        # chunked, no declared length: read up to the limit first, so a body over it is a
        # clean 413 and the upstream never sees half a request
        try:
            body = await read_body(request, rules.max_body_bytes, decode=False)
        except GatewayError as err:
            return error_response(err, flavor)
    if span is not None:
        extra = {**(extra or {}), **span.upstream(request, up)}
    try:
        return await relay(request, state.pool, up, body, info, extra,
                           rules.tenants.credential_headers)
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
