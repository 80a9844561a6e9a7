"""The gateway's own error answers, in the format of the API the caller speaks.

`flavor_for` tells which format the caller's SDK reads, `error_response` renders a
GatewayError in it, and the `contained_paths` middleware answers a path with dot-segments
or a target no route takes in it (never aiohttp's plain text). The relays, the listener
split and the HTTP server's own error answers all answer through here.
"""

from __future__ import annotations

from typing import Literal

from aiohttp import web
from aiohttp.typedefs import Handler

from gateway.errors import ApiFlavor, BadPath, GatewayError, render_error
from gateway.proxy.upstream import has_dot_segment


def flavor_for(request: web.BaseRequest) -> ApiFlavor:
    """The error shape the caller's SDK reads: Anthropic's on its Messages routes, OpenAI's
    on the chat and Responses routes (Azure's too) whatever the headers, and elsewhere
    Anthropic's for a request carrying Anthropic's headers (`caller_wire`)."""
    path = request.path
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith(_OPENAI_ROUTES) or caller_wire(request) != "anthropic":
        return "openai"
    return "anthropic"


_OPENAI_ROUTES = ("/v1/chat/completions", "/v1/responses", "/openai/")


def caller_wire(request: web.BaseRequest) -> Literal["anthropic"] | None:
    """The API a request speaks by its headers: `anthropic` when it carries
    `anthropic-version` (every Anthropic SDK call sends it, its models.list too; the API
    refuses a call without it) or an `x-api-key` without `Authorization` (Anthropic's key
    header: OpenAI's SDKs send `Authorization`, Azure's `api-key`); None: not known, the
    path alone routes it. Routing chooses among the configured upstreams by it
    (Rules.upstream_for)."""
    headers = request.headers
    if "anthropic-version" in headers or ("x-api-key" in headers
                                          and "Authorization" not in headers):
        return "anthropic"
    return None


def error_response(err: GatewayError, flavor: ApiFlavor) -> web.Response:
    """`err` as a JSON answer with its status, in the `flavor` the caller reads."""
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
