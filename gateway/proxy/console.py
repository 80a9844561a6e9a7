"""The operator console's routes: the pages, behind the admin token.

Off unless `console.enabled`: then no observer is registered and nothing is kept. On,
`sync` registers the observer (gateway.observe.console_log keeps what it sees, in fixed
bounds) and a GET renders the page from it (gateway.observe.console_view).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from gateway.config.schema import Rules
from gateway.memory.backends import Backend
from gateway.observe import console_view as view
from gateway.observe.console_log import SESSION_CHARS, Console
from gateway.proxy.appstate import STATE, GatewayState

LOGIN_BYTES = 4096
COOKIE = "memgate_console"
COOKIE_MAX_AGE_S = 12 * 3600
# this process's place under `serve --workers N`: (worker index, N); None: the only one
_WORKER: tuple[int, int] | None = None
_NEXT = re.compile(r"/admin/console(/session\?id=[A-Za-z0-9._~%+:@/-]{1,400}"
                   r"(&t=[A-Za-z0-9._~%+:@/-]{0,400})?)?")


def sync(state: GatewayState, rules: Rules) -> None:
    """Start, resize or stop the console to match the rules (startup and every reload):
    off, no observer is registered and what it kept is let go."""
    cr = rules.console
    console = state.console
    if cr.enabled and console is None:
        state.console = console = Console(cr)
        state.observers.append(console.observe)
    elif cr.enabled and console is not None:
        console.configure(cr)
    elif console is not None:
        state.observers.remove(console.observe)
        state.console = None


# --------------------------------------------------------------------------- HTTP


def _cookie_value(token: str) -> str:
    """The login cookie: derived from the token, so the cookie jar never holds it."""
    return hmac.new(token.encode("utf-8", "surrogateescape"), b"memgate-console-v1",
                    hashlib.sha256).hexdigest()


def _same(a: str, b: str) -> bool:
    # a header's non-UTF-8 bytes arrive as surrogate escapes: compared as the bytes sent
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"),
                               b.encode("utf-8", "surrogateescape"))


def _page(body: str, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=body, status=status, content_type="text/html", charset="utf-8",
                        headers={**view.SECURITY_HEADERS, **(headers or {})})


def _refusal(request: web.Request, login: bool = True) -> web.Response | None:
    """Why this request may not see the console (a page to answer), or None. The same
    rules as the admin API: loopback only unless opened, off without MEMGATE_ADMIN_TOKEN."""
    state: GatewayState = request.app[STATE]
    env = state.reloader.env
    if request.remote not in ("127.0.0.1", "::1") and env.get("MEMGATE_ADMIN_ALLOW_REMOTE") != "1":
        return _page(view.message_page("The console is loopback-only (set "
                                       "MEMGATE_ADMIN_ALLOW_REMOTE=1 to open it)."), 403)
    token = env.get("MEMGATE_ADMIN_TOKEN", "")
    if not token:
        return _page(view.message_page("The console is off: set MEMGATE_ADMIN_TOKEN."), 404)
    if state.console is None:
        return _page(view.message_page("The console is off: set console.enabled: true."), 404)
    if not login:
        return None
    given = request.headers.get("X-Memgate-Admin-Token")
    if given is not None:
        ok = _same(token, given)
    else:
        ok = _same(_cookie_value(token), request.cookies.get(COOKIE, ""))
    if ok:
        return None
    then = request.path_qs if _NEXT.fullmatch(request.path_qs) else "/admin/console"
    return _page(view.login_page(wrong=given is not None, then=then), 401)


def set_worker(index: int, workers: int) -> None:
    """Called by `serve` in a worker: the pages then say whose requests they show."""
    global _WORKER
    _WORKER = (index, workers)


def process() -> view.Process:
    pid = os.getpid()
    return view.Process(pid) if _WORKER is None else view.Process(pid, *_WORKER)


def _status(state: GatewayState) -> view.Status:
    """The switch, the last reload and the backends' health, as the page shows them."""
    rules = state.rules
    backends: list[tuple[str, str, dict[str, Any]]] = []
    sessions = state.sessions
    health: Backend | None = getattr(sessions, "health", None)
    backends.append(("state", sessions.backend,
                     health.status() if health is not None else {"status": "ok"}))
    opened = state.memory is not None and state.memory.store is not None
    backends.append(("store", rules.store.backend,
                     {**state.store_health.status(), "opened": opened}))
    backends.append(("archive", rules.store.backend, state.archive_health.status()))
    r = state.reloader
    return view.Status(rules=rules, last_reload=r.last, reload_file=r.last_file,
                       reload_trigger=r.last_trigger, reloads_ok=r.ok, reloads_failed=r.failed,
                       backends=backends, process=process())


def _refresh_s(request: web.Request) -> int:
    """The page reloads itself every ?refresh= seconds (0: never; default 10)."""
    raw = request.query.get("refresh", "")
    return max(0, min(3600, int(raw))) if raw.isdigit() and len(raw) < 6 else view.REFRESH_S


async def page(request: web.Request) -> web.Response:
    """GET /admin/console: the switch, the backends, the last hour, the largest sessions."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    state: GatewayState = request.app[STATE]
    assert state.console is not None
    return _page(view.main_page(_status(state), state.console.hour(),
                                state.console.largest(), state.console.rules,
                                _refresh_s(request)))


async def session_page(request: web.Request) -> web.Response:
    """GET /admin/console/session?id=<session>&t=<tenant>: one session's recent requests
    (no `t`: the session of callers without a credential)."""
    refused = _refusal(request)
    if refused is not None:
        return refused
    state: GatewayState = request.app[STATE]
    assert state.console is not None
    sid = request.query.get("id", "")
    tenant = request.query.get("t", "")
    log = state.console.sessions.get((tenant[:SESSION_CHARS], sid[:SESSION_CHARS]))
    if log is None:
        return _page(view.message_page("No recent requests of this session (it may have "
                                       "been forgotten: console.max_sessions)."), 404)
    return _page(view.session_page(sid, log, state.console.rules, _refresh_s(request),
                                   tenant=tenant, process=process()))


async def login(request: web.Request) -> web.Response:
    """POST /admin/console/login (form field `token`): sets the HttpOnly cookie."""
    refused = _refusal(request, login=False)
    if refused is not None:
        return refused
    state: GatewayState = request.app[STATE]
    token = state.reloader.env.get("MEMGATE_ADMIN_TOKEN", "")
    raw = await request.content.read(LOGIN_BYTES + 1)
    if len(raw) > LOGIN_BYTES:
        return _page(view.message_page("Login form too large."), 413)
    form = parse_qs(raw.decode("utf-8", "replace"))
    then = form.get("next", ["/admin/console"])[0]
    if not _NEXT.fullmatch(then):  # only a console page: never a redirect elsewhere
        then = "/admin/console"
    if not _same(token, form.get("token", [""])[0]):
        return _page(view.login_page(wrong=True, then=then), 401)
    # a page that moves on by itself: a redirect would carry the POST's (maybe
    # cross-site) origin, and a SameSite=Strict cookie is not sent along such a chain
    resp = _page(view.signed_in_page(then), 200)
    resp.set_cookie(COOKIE, _cookie_value(token), max_age=COOKIE_MAX_AGE_S,
                    path="/admin/console", httponly=True, samesite="Strict",
                    secure=request.secure)
    return resp


async def logout(request: web.Request) -> web.Response:
    """POST /admin/console/logout: the cookie is cleared."""
    resp = _page(view.login_page(wrong=False), 200)
    resp.del_cookie(COOKIE, path="/admin/console")
    return resp


def routes() -> Iterator[web.RouteDef]:
    """The console's routes, all under /admin/console (they move with the admin API)."""
    yield web.get("/admin/console", page)
    yield web.get("/admin/console/session", session_page)
    yield web.post("/admin/console/login", login)
    yield web.post("/admin/console/logout", logout)
