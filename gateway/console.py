"""The operator console: what the gateway did, in the browser, behind the admin token.

Off unless `console.enabled`: then no observer is registered and nothing is kept. On, an
observer reads each request once, right after its [mem] line (its fields and decision),
into fixed bounds: a bucket per minute for the last hour, and for at most
`console.max_sessions` sessions (the least recently seen forgotten first) a ring of their
last `console.ring` requests. A GET renders the page from those (console_view.py): sizes,
roles, stages and ids; the text of the carry note and of recalled records only with
`console.show_text`; never a message's text, a header or a credential.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from . import console_view as view
from .backends import Backend
from .gwstate import STATE, GatewayState
from .rules import ConsoleRules, Rules

MINUTES = 60  # the last hour, a bucket a minute
SAMPLES = 512  # overhead samples per minute for the percentiles (a reservoir beyond)
STRIP_SEGMENTS = 240  # runs of one request's message strip; the rest merged into one
TEXT_CHARS = 2000  # of the note and of each recalled record (show_text only)
RECORDS_SHOWN = 5
SESSION_CHARS = 128  # session ids come from clients
TOP_SESSIONS = 20
LOGIN_BYTES = 4096
COOKIE = "memgate_console"
COOKIE_MAX_AGE_S = 12 * 3600
# this process's place under `serve --workers N`: (worker index, N); None: the only one
_WORKER: tuple[int, int] | None = None
_NEXT = re.compile(r"/admin/console(/session\?id=[A-Za-z0-9._~%+:@/-]{1,400}"
                   r"(&t=[A-Za-z0-9._~%+:@/-]{0,400})?)?")

# the [mem] fields a request's row shows (all small numbers, names and flags)
SHOWN = ("turn", "hist_msgs", "hist_chars", "est_tokens", "budget_tokens", "evict",
         "would_evict", "kept", "dropped", "would_drop", "pinned", "pinned_overflow",
         "recalled", "recalled_tokens", "recalled_records", "recall", "compacted",
         "compacted_saved_tokens", "over_budget", "cut", "prefix_tokens", "carried", "mode",
         "status", "upstream_ms", "overhead_ms", "req", "api", "stream", "fallback",
         "first_status", "usage_in", "usage_cached", "usage_out", "usage_cache_write",
         "state", "reason", "archived", "media", "tokenizer")
_SHOWN = frozenset(SHOWN)

Segment = tuple[int, int, str]  # first message, count, kind
# (tenant, session): the tenant id (`t-<16 hex>`, the configured anonymous name, or "" for
# a caller without a credential) keeps apart the sessions of two tenants that share an id
SessionKey = tuple[str, str]
# why the planner kept a message -> its kind on the strip (any other reason: kept)
_KEPT_AS = {k: k for k in ("system", "current", "pinned", "recalled")}


@dataclass(slots=True)
class Minute:
    """What one minute's requests added up to."""

    minute: int
    requests: int = 0
    client_tokens: int = 0  # est_tokens: the history as the client sent it
    forwarded_tokens: int = 0  # the history as forwarded (what the plan kept)
    usage_requests: int = 0  # answers that carried the provider's usage
    usage_in: int = 0
    usage_cached: int = 0
    usage_out: int = 0
    over_budget: int = 0
    fallback: int = 0
    errors: int = 0  # status >= 400 (499: the client left)
    dropped: dict[str, int] = field(default_factory=dict)  # stage -> messages (or would)
    overhead: list[float] = field(default_factory=list)
    offered: int = 0  # overhead samples seen (the reservoir keeps SAMPLES of them)


@dataclass(slots=True)
class Seen:
    """One request as a session's ring keeps it."""

    at: float
    fields: dict[str, Any]  # the SHOWN [mem] fields it had
    model: str | None
    forwarded_tokens: int
    strip: tuple[Segment, ...]
    note_chars: int | None
    note: str | None  # show_text only
    records: tuple[int, ...]  # characters of each recalled record
    record_texts: tuple[str, ...]  # show_text only


@dataclass(slots=True)
class SessionLog:
    ring: deque[Seen]
    requests: int = 0


def message_strip(d: Any) -> tuple[tuple[Segment, ...], dict[str, int]]:
    """The decision's messages as runs of one kind (system, current, pinned, recalled,
    compacted, kept, drop:<stage>), and the messages each stage dropped (or would drop,
    in shadow). Walks the kept messages and the dropped runs, never each dropped message."""
    n = len(d.messages) if d is not None and d.conv is not None else 0
    p = d.plan if n else None
    if p is None or (not p.dropped and p.kept_by[:1] == ("fits",)):
        return ((0, n, "kept"),) if n else (), {}
    kept: list[Segment] = []
    compacted = d.compacted
    start, last, run = -2, -2, ""
    for i, by in zip(p.kept, p.kept_by):
        kind = "compacted" if compacted and i in compacted else _KEPT_AS.get(by, "kept")
        if i == last + 1 and kind == run:
            last = i
            continue
        if run:
            kept.append((start, last - start + 1, run))
        start, last, run = i, i, kind
    if run:
        kept.append((start, last - start + 1, run))
    dropped: dict[str, int] = {}
    out: list[Segment] = []
    k = 0
    for lo, hi, stage in p.dropped.spans():
        while k < len(kept) and kept[k][0] < lo:
            out.append(kept[k])
            k += 1
        at = lo
        while k < len(kept) and kept[k][0] <= hi:  # fixed messages inside the run
            if kept[k][0] > at:
                out.append((at, kept[k][0] - at, f"drop:{stage}"))
                dropped[stage] = dropped.get(stage, 0) + kept[k][0] - at
            out.append(kept[k])
            at = kept[k][0] + kept[k][1]
            k += 1
        if hi + 1 > at:
            out.append((at, hi + 1 - at, f"drop:{stage}"))
            dropped[stage] = dropped.get(stage, 0) + hi + 1 - at
    out.extend(kept[k:])
    if len(out) > STRIP_SEGMENTS:
        first = out[STRIP_SEGMENTS - 1][0]
        out[STRIP_SEGMENTS - 1:] = [(first, n - first, "more")]
    return tuple(out), dropped


def forwarded_tokens(fields: dict[str, Any], d: Any) -> int:
    """The history's tokens as forwarded (the carry note not included), as the
    memgate_history_tokens_after metric counts them."""
    est = int(fields.get("est_tokens") or 0)
    p = d.plan if d is not None else None
    if p is not None and d.conv is not None and d.mode == "on" and (p.dropped or d.compacted):
        return int(d.kept_tokens())
    return est


class Console:
    """The console's bounded memory of recent requests; `observe` is the observer."""

    def __init__(self, rules: ConsoleRules, clock: Callable[[], float] = time.time) -> None:
        self.rules = rules
        self.clock = clock
        self.minutes: list[Minute | None] = [None] * MINUTES
        self.sessions: OrderedDict[SessionKey, SessionLog] = OrderedDict()
        self._rnd = random.Random(0)  # the reservoir's draws: reproducible

    def configure(self, rules: ConsoleRules) -> None:
        """A reload: keep what fits the new bounds."""
        if rules.ring != self.rules.ring:
            for log in self.sessions.values():
                log.ring = deque(log.ring, maxlen=rules.ring)
        if self.rules.show_text and not rules.show_text:  # what was kept is let go too
            for log in self.sessions.values():
                log.ring = deque((_without_text(s) for s in log.ring), maxlen=rules.ring)
        while len(self.sessions) > rules.max_sessions:
            self.sessions.popitem(last=False)
        self.rules = rules

    def _minute(self, now: float) -> Minute:
        m = int(now // 60)
        slot = self.minutes[m % MINUTES]
        if slot is None or slot.minute != m:
            slot = self.minutes[m % MINUTES] = Minute(m)
        return slot

    def observe(self, fields: dict[str, Any], d: Any, info: Any) -> None:
        """One request, after its [mem] line: counted into its minute and its session."""
        now = self.clock()
        b = self._minute(now)
        strip, dropped = message_strip(d)
        fwd = forwarded_tokens(fields, d)
        b.requests += 1
        b.client_tokens += int(fields.get("est_tokens") or 0)
        b.forwarded_tokens += fwd
        if "usage_in" in fields:
            b.usage_requests += 1
            b.usage_in += int(fields["usage_in"] or 0)
            b.usage_cached += int(fields.get("usage_cached") or 0)
            b.usage_out += int(fields.get("usage_out") or 0)
        b.over_budget += bool(fields.get("over_budget"))
        b.fallback += "fallback" in fields
        b.errors += int(fields.get("status") or 0) >= 400
        for stage, count in dropped.items():
            b.dropped[stage] = b.dropped.get(stage, 0) + count
        self._sample(b, float(fields.get("overhead_ms") or 0.0))
        session = str(fields.get("session") or "")[:SESSION_CHARS]
        if session:
            tenant = str(getattr(info, "tenant", None) or "")[:SESSION_CHARS]
            self._remember((tenant, session), self._seen(now, fields, d, fwd, strip))

    def _sample(self, b: Minute, value: float) -> None:
        b.offered += 1
        if len(b.overhead) < SAMPLES:
            b.overhead.append(value)
        else:
            k = self._rnd.randrange(b.offered)
            if k < SAMPLES:
                b.overhead[k] = value

    def _seen(self, now: float, fields: dict[str, Any], d: Any, fwd: int,
              strip: tuple[Segment, ...]) -> Seen:
        text = self.rules.show_text
        note = d.note if d is not None else None
        records = tuple(d.recalled[:RECORDS_SHOWN]) if d is not None else ()
        model = fields.get("model")
        return Seen(
            at=now, fields={k: v for k, v in fields.items() if k in _SHOWN},
            model=str(model)[:80] if model is not None else None, forwarded_tokens=fwd,
            strip=strip, note_chars=len(note) if note is not None else None,
            note=note[:TEXT_CHARS] if text and note is not None else None,
            records=tuple(len(r) for r in records),
            record_texts=tuple(r[:TEXT_CHARS] for r in records) if text else (),
        )

    def _remember(self, key: SessionKey, seen: Seen) -> None:
        log = self.sessions.get(key)
        if log is None:
            log = self.sessions[key] = SessionLog(deque(maxlen=self.rules.ring))
            while len(self.sessions) > self.rules.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(key)
        log.ring.append(seen)
        log.requests += 1

    def hour(self) -> list[Minute]:
        """The last 60 minutes, oldest first; a minute without requests is empty."""
        m = int(self.clock() // 60)
        out = []
        for k in range(m - MINUTES + 1, m + 1):
            slot = self.minutes[k % MINUTES]
            out.append(slot if slot is not None and slot.minute == k else Minute(k))
        return out

    def largest(self, n: int = TOP_SESSIONS) -> list[tuple[SessionKey, SessionLog]]:
        """The sessions whose latest request had the largest history."""
        def size(item: tuple[SessionKey, SessionLog]) -> tuple[int, float]:
            last = item[1].ring[-1]
            return int(last.fields.get("est_tokens") or 0), last.at
        return sorted(self.sessions.items(), key=size, reverse=True)[:n]


def _without_text(s: Seen) -> Seen:
    return Seen(s.at, s.fields, s.model, s.forwarded_tokens, s.strip, s.note_chars, None,
                s.records, ())


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
