"""A request's session: its id, and the record of what the session forwarded last.

`session_of` names the session (the first source of `session.id_from` that names one,
see `gateway.memory.session_sources`) and `remember_response` keeps which session a
Responses answer belonged to, for the request that continues it. `measure_session`
measures a parsed history against the session's record (the tokens of a resent prefix are
not summed again; cut=, prefix_tokens) and writes this request's record for the next one;
`resent` rewrites the fields and the record when the upstream refused the changed body
and got the client's. Session state that is down marks the fields (`state=unavailable`),
never fails the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

from gateway.config.schema import Rules
from gateway.decide.decision import Decision
from gateway.memory.backends import BackendDown
from gateway.memory.session_sources import CHAINED, candidates, clean
from gateway.memory.state import SessionRecord, compare_cut, fingerprint, known_prefix, runs
from gateway.observe.relayed import Relayed
from gateway.proxy.appstate import GatewayState
from gateway.proxy.mem_line import mem_fields
from gateway.wire.base import Wire
from gateway.wire.openai_responses import OPENAI_RESPONSES

# a history with more uncounted text than this is token-counted for the [mem] line on the
# gateway's counting thread (while the upstream answers, off the event loop)
OFFLOAD_CHARS = 65_536


async def session_of(state: GatewayState, rules: Rules, request: web.Request, payload: Any,
                     items: list[Any] | None, tenant: str | None) -> tuple[str, str]:
    """(session id, the source that named it): the first source of `session.id_from`
    that names one. A `previous_response_id` names the session of the answer it
    continues, when this tenant's state knows that answer; else the next source is read
    (a response id is no session id)."""
    body = payload if isinstance(payload, dict) else {}
    for source, value in candidates(rules.session_id_from, request.headers, body, items,
                                    tenant, rules.memory.context_prefixes):
        if source != CHAINED:
            return value, source
        if tenant is None:  # no state: nothing was remembered for this caller
            continue
        try:
            found = await state.sessions.get_response_session(tenant, value)
        except BackendDown:  # counted and logged by the breaker
            continue
        if found is not None:
            return found, source
    raise AssertionError("the loader makes fingerprint the last source")


async def remember_response(state: GatewayState, tenant: str | None, session: str,
                            wire: Wire, info: Relayed) -> None:
    """A Responses answer's id -> its session, for the request that continues it
    (`previous_response_id`). In-process, the write happens before anything yields, so
    a client's next request always finds it; in Redis, within a round trip."""
    rid = info.response_id
    if (tenant is None or not session or rid is None or wire is not OPENAI_RESPONSES
            or info.status != 200 or CHAINED not in state.rules.session_id_from):
        return
    try:
        await state.sessions.put_response_session(tenant, clean(rid), session)
    except BackendDown:  # counted and logged by the breaker; the chain falls through
        pass


async def measure_session(
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


async def resent(
    state: GatewayState, tenant: str | None, session: str, d: Decision,
    measured: tuple[dict[str, Any], dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The upstream refused the changed body and got the client's (`d`, unchanged now):
    the line, the metrics and the session record say what went, and the session's next
    requests go unchanged for memory.fallback_backoff_s (the chat route marks it). The
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
