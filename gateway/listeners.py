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

from collections.abc import Awaitable, Callable

from aiohttp import web

from .errors import GatewayError
from .rules import Rules

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

# (host, port) of the admin listener, or None when everything is on the main one; fixed
# at start-up (a reload cannot rebind sockets)
ADMIN_LISTEN = web.AppKey("memgate_admin_listen", tuple)
PROBES = frozenset(("/healthz", "/readyz"))


class NotHere(GatewayError):
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
    from .handlers import error_response, flavor_for, passthrough

    listen = admin_listen(rules)
    if listen is None:
        return []
    admin_port = listen[1]

    @web.middleware
    async def split_listeners(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        on_admin = _local_port(request) == admin_port
        if on_admin:
            # what the admin listener serves is its own routes: never the upstream relay
            # (the catch-all would otherwise relay a POST /metrics or GET /v1/models)
            wrong = (not is_admin_path(path) and path not in PROBES) or (
                request.match_info.handler is passthrough)
            reason = ("the admin listener (listen.admin_port) serves only /metrics, /admin/*, "
                      "/healthz and /readyz" if not is_admin_path(path) else
                      f"no {request.method} route here: the admin listener relays nothing")
        else:
            wrong = is_admin_path(path)
            reason = ("/metrics and /admin/* are served on the admin listener "
                      "(listen.admin_port), not on this port")
        if wrong:
            return error_response(NotHere(reason), flavor_for(path))
        return await handler(request)

    return [split_listeners]


async def start_admin_site(runner: web.BaseRunner, main: web.TCPSite,
                           listen: tuple[str, int] | None) -> web.TCPSite | None:
    """Bind the admin listener (if configured) on `runner`, with the main site's socket
    options: what lets N processes share the main port lets them share this one."""
    if listen is None:
        return None
    site = web.TCPSite(runner, listen[0], listen[1], backlog=128,
                       reuse_address=getattr(main, "_reuse_address", None),
                       reuse_port=getattr(main, "_reuse_port", None))
    await site.start()
    return site
