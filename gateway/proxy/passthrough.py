"""Every route the gateway does not intercept (models, files, embeddings, the Realtime
websocket...): relayed to its upstream as is.

No [mem] line: a short `relay` line and memgate_relayed_total by route class (never the
raw path), and an HTTP span while tracing is on. The body limit is the chat routes':
over limits.max_body_bytes, as declared, as it arrives or once decoded, is a 413 before
anything is forwarded. A body with a Content-Length within it and no Content-Encoding
streams through unread; a chunked or compressed one is read (and a compressed one
inflated, only to count) within the limit first, then relayed as sent.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.errors import GatewayError, Unauthorized
from gateway.observe.metrics import route_class
from gateway.observe.relayed import Relayed
from gateway.proxy.appstate import STATE, GatewayState
from gateway.proxy.error_answers import caller_wire, error_response, flavor_for
from gateway.proxy.intake import admit, read_body, streams_unread
from gateway.proxy.upstream import is_websocket, relay, relay_websocket

if TYPE_CHECKING:  # the optional extra: imported only while tracing is on
    from gateway.observe.otel import RequestSpan


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
    """A body with a Content-Length within limits.max_body_bytes and no encoding is
    streamed through as it arrives (never held); a chunked or compressed one is read
    within the limit first, so one over it is a clean 413 and the upstream never sees
    half a request: that costs holding up to the limit per such request, and, for a
    compressed one, inflating it (the decoded bytes are counted and dropped)."""
    rules = state.rules
    flavor = flavor_for(request)
    up = rules.upstream_for(request.path, None, caller_wire(request))
    try:
        admit(rules, up, request)
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
    try:
        if not request.body_exists:
            extra = {"Content-Length": str(declared)} if declared is not None else None
        elif streams_unread(request, rules.max_body_bytes):  # as it arrives
            extra = {"Content-Length": str(declared)}
            body = request.content
        else:  # chunked or compressed: counted (and inflated within the limit) first
            body = await read_body(request, rules.max_body_bytes, as_sent=True)
    except GatewayError as err:
        return error_response(err, flavor)
    if span is not None:
        extra = {**(extra or {}), **span.upstream(request, up)}
    try:
        return await relay(request, state.pool, up, body, info, extra,
                           rules.tenants.credential_headers)
    except GatewayError as err:
        return error_response(err, flavor)
