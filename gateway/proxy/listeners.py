"""Which listener serves what: `/metrics` and `/admin/*` on the main port, or, with
`listen.admin_port`, on an admin listener of their own.

With an admin port the main listener (the one a Service or load balancer exposes) no
longer answers `/metrics` or anything under `/admin` (a 404 in the API's error shape: a
scrape or an admin call aimed at the wrong port fails loudly instead of being relayed
to the provider), and the admin listener serves only those, plus `/healthz` and
`/readyz` for probes; it never relays to an upstream. The split goes by path prefix, not
by a list of routes, so a route added under `/admin` later moves with the rest.

One app, one runner, two sites: a request is told apart by the local port it came in on
(`listen.admin_port` is a fixed port, never 0, and never the main one). The admin site is
bound like the main site (`reuse_port` included), so several worker processes that share
the main port share the admin port the same way.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from gateway.config.schema import Rules
from gateway.errors import GatewayError
from gateway.proxy.error_answers import error_response, flavor_for
from gateway.proxy.passthrough import passthrough

# (host, port) of the admin listener, or None when everything is on the main one; fixed
# at start-up (a reload cannot rebind sockets)
ADMIN_LISTEN: web.AppKey[tuple[str, int] | None] = web.AppKey("memgate_admin_listen")
PROBES = frozenset(("/healthz", "/readyz"))


class NotHere(GatewayError):
    """A route of the other listener (its own code: an admin route's own 404 says
    `not_found`)."""

    status = 404
    code = "wrong_listener"


class NoRoute(GatewayError):
    """A path of the admin listener's that none of its routes serves."""

    status = 404
    code = "not_found"


def is_admin_path(path: str) -> bool:
    """The routes that move to the admin listener: `/metrics` and everything under `/admin`."""
    return path == "/metrics" or path == "/admin" or path.startswith("/admin/")


def admin_listen(rules: Rules) -> tuple[str, int] | None:
    port = rules.listen_admin_port
    return None if port is None else (rules.listen_admin_host, port)


def _local_port(request: web.Request) -> int | None:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None


def split_middlewares(rules: Rules) -> list[Middleware]:
    """The middleware that keeps each listener to its routes; none without an admin port."""
    listen = admin_listen(rules)
    if listen is None:
        return []
    admin_port = listen[1]

    @web.middleware
    async def split_listeners(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        on_admin = _local_port(request) == admin_port
        if on_admin:
            # the admin listener serves its own routes only: never the upstream relay (the
            # catch-all would otherwise relay a POST /metrics or a GET /v1/models)
            relay = request.match_info.handler is passthrough
            if not is_admin_path(path) and (path not in PROBES or relay):
                return error_response(NotHere(
                    "the admin listener (listen.admin_port) serves only /metrics, /admin/*, "
                    "GET /healthz and GET /readyz"), flavor_for(request))
            if relay:
                return error_response(NoRoute(f"no {request.method} route here: the admin "
                                              "listener relays nothing"), flavor_for(request))
        elif is_admin_path(path):
            return error_response(NotHere("/metrics and /admin/* are served on the admin "
                                          "listener (listen.admin_port), not on this port"),
                                  flavor_for(request))
        return await handler(request)

    return [split_listeners]


async def start_admin_site(runner: web.BaseRunner, main: web.BaseSite | None,
                           listen: tuple[str, int] | None,
                           reuse_port: bool | None = None) -> web.TCPSite | None:
    """Bind the admin listener (if configured) on `runner`, with the main site's socket
    options (or `reuse_port` when given: a main socket bound by hand has none to copy):
    what lets N processes share the main port lets them share this one."""
    if listen is None:
        return None
    site = web.TCPSite(runner, listen[0], listen[1], backlog=128,
                       reuse_address=getattr(main, "_reuse_address", None),
                       reuse_port=reuse_port if reuse_port is not None
                       else getattr(main, "_reuse_port", None))
    await site.start()
    return site
