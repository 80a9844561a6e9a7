"""The console's pages: HTML with SVG charts drawn here, no script, no asset fetched.

Pure functions of what console.py kept. Everything that came from a client (session
ids, model names, the note and record texts when shown) is escaped; numbers a test or a
script may read carry their exact value in `data-value`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from gateway.config.schema import ConsoleRules, Rules

if TYPE_CHECKING:
    from gateway.observe.console_log import Minute, Seen, SessionLog

REFRESH_S = 10
SECURITY_HEADERS = {
    # nothing but this document: no script at all, inline styles, forms to itself
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "img-src 'self' data:; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
}
KIND_COLORS = {"system": "#64748b", "current": "#2563eb", "pinned": "#7c3aed",
               "recalled": "#0891b2", "compacted": "#d97706", "kept": "#16a34a",
               "more": "#cbd5e1"}
STAGE_COLORS = {"length": "#dc2626", "recent_turns": "#f97316", "score": "#db2777",
                "pinned": "#9f1239", "compact_tools": "#b45309"}
CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f8fafc;color:#0f172a}
header{background:#0f172a;color:#f8fafc;padding:10px 20px;display:flex;gap:16px;
align-items:center}header h1{font-size:18px;margin:0}header a{color:#cbd5e1}
header form{margin-left:auto}main{padding:12px 20px}
section{background:#fff;border:1px solid #e2e8f0;border-radius:6px;padding:10px 14px;
margin-bottom:12px}h2{font-size:15px;margin:0 0 8px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:16px}
.cards{display:flex;flex-wrap:wrap;gap:8px}.card{border:1px solid #e2e8f0;border-radius:6px;
padding:6px 10px;min-width:110px}.card b{display:block;font-size:18px}
.card span{color:#475569;font-size:12px}table{border-collapse:collapse;width:100%}
td,th{text-align:left;padding:3px 8px;border-bottom:1px solid #e2e8f0;font-size:13px;
white-space:nowrap}th{color:#475569;font-weight:600}.num{text-align:right;
font-variant-numeric:tabular-nums}.pill{display:inline-block;border-radius:10px;
padding:1px 8px;font-size:12px;color:#fff}.ok{background:#16a34a}.bad{background:#dc2626}
.warn{background:#d97706}.off{background:#64748b}.legend span{margin-right:12px;
font-size:12px}.sw{display:inline-block;width:10px;height:10px;margin-right:4px;
border-radius:2px}.req{border-top:1px solid #e2e8f0;padding:8px 0}.mono{font-family:
ui-monospace,monospace;font-size:12px}.kvs{display:flex;flex-wrap:wrap;gap:4px 18px;
margin:4px 0;font-size:13px}
.kvs span{color:#475569}.kvs b{color:#0f172a}pre{white-space:pre-wrap;background:#f1f5f9;
padding:6px;margin:4px 0;max-height:160px;overflow:auto}.err{color:#b91c1c}
"""


@dataclass(frozen=True, slots=True)
class Process:
    """The process that renders the page: under `serve --workers N` one of N, each with
    its own console (the requests it answered), reached as the kernel hands it the
    connection."""

    pid: int
    worker: int | None = None  # the `worker=K` of its log lines (None: the only process)
    workers: int = 1

    def row(self) -> str:
        pid = f'pid <b id="pid" data-value="{self.pid}">{self.pid}</b>'
        if self.worker is None:
            return pid
        return (f'worker <b id="worker" data-value="{self.worker}">{self.worker}</b> of '
                f"{self.workers} ({pid}): {_pill('this worker only', 'warn')} the requests "
                "below are the ones this worker answered; each worker keeps its own, and "
                "the next load may be answered by another")

    def footer(self) -> str:
        if self.worker is None:
            return f"pid {self.pid}"
        return f"worker {self.worker} of {self.workers}, pid {self.pid}: its requests only"


@dataclass(frozen=True, slots=True)
class Status:
    rules: Rules
    last_reload: tuple[float, str, str | None] | None
    reload_file: str | None
    reload_trigger: str | None
    reloads_ok: int
    reloads_failed: int
    backends: list[tuple[str, str, dict[str, Any]]]  # (role, backend, Backend.status())
    process: Process | None = None  # None: not said (a page rendered outside a gateway)


def _e(v: Any) -> str:
    return escape(str(v), quote=True)


def _clock(wall: float, seconds: bool = False) -> str:
    return time.strftime("%H:%M:%S" if seconds else "%H:%M", time.gmtime(wall))


def _n(v: float | int | None) -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:,.2f}"
    return f"{int(v):,}"


def _fig(key: str, label: str, value: float | int | None, note: str = "") -> str:
    raw = "" if value is None else (f"{value:.4f}" if isinstance(value, float) else str(value))
    return (f'<div class="card"><b id="fig-{key}" data-value="{raw}">{_n(value)}{note}</b>'
            f"<span>{_e(label)}</span></div>")


def _doc(title: str, body: str, refresh_s: int = 0, nav: bool = True, to: str = "") -> str:
    """A page; it reloads itself every `refresh_s` seconds (to `to`, when given)."""
    target = f";url={to}" if to else ""
    meta = (f'<meta http-equiv="refresh" content="{refresh_s}{target}">'
            if refresh_s or to else "")
    out = ('<form method="post" action="/admin/console/logout"><button>Sign out</button></form>'
           if nav else "")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
            f'<meta name="viewport" content="width=device-width">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body><header>"
            f'<h1>memgate console</h1><a href="/admin/console">overview</a>{out}</header>'
            f"<main>{body}</main></body></html>")


def message_page(text: str) -> str:
    return _doc("memgate console", f"<section><p>{_e(text)}</p></section>", nav=False)


def login_page(wrong: bool, then: str = "/admin/console") -> str:
    err = '<p class="err">Wrong admin token.</p>' if wrong else ""
    return _doc("memgate console: sign in", (
        f'<section><h2>Sign in</h2>{err}<form method="post" action="/admin/console/login">'
        '<label>Admin token (MEMGATE_ADMIN_TOKEN) <input type="password" name="token" '
        'autocomplete="current-password" autofocus></label> <button>Sign in</button>'
        f'<input type="hidden" name="next" value="{_e(then)}">'
        "</form></section>"), nav=False)


def signed_in_page(then: str = "/admin/console") -> str:
    return _doc("memgate console", f'<section><p>Signed in. <a href="{_e(then)}">Open the '
                "console</a>.</p></section>", nav=False, to=_e(then))


# --------------------------------------------------------------------------- charts

Series = tuple[str, str, Sequence[float | None]]  # name, color, a value per minute
W, H, LEFT, BOTTOM, TOP = 640, 200, 58, 20, 8


def _ceiling(v: float) -> float:
    """A round axis maximum at or above v."""
    if v <= 0:
        return 1.0
    mag = 10.0 ** math.floor(math.log10(v))
    return next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= v)


def chart(title: str, hour: Sequence[Minute], bars: Sequence[Series] = (),
          lines: Sequence[Series] = (), unit: str = "") -> str:
    """A per-minute chart of the last hour: stacked bars and lines on one axis."""
    n = len(hour)
    stack = [sum(v or 0 for _, _, vs in bars for v in (vs[i],)) for i in range(n)]
    peak = max([*stack, *(v for _, _, vs in lines for v in vs if v is not None), 0])
    top = _ceiling(peak)
    pw, ph = W - LEFT - 8, H - BOTTOM - TOP
    step = pw / max(n, 1)

    def y(v: float) -> float:
        return TOP + ph - v / top * ph

    parts = [f'<svg viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="{_e(title)}" '
             'font-size="12" fill="#475569">']
    for frac in (0, 0.5, 1):
        yy = y(top * frac)
        parts.append(f'<line x1="{LEFT}" x2="{W - 8}" y1="{yy:.1f}" y2="{yy:.1f}" '
                     'stroke="#e2e8f0"/>')
        parts.append(f'<text x="{LEFT - 4}" y="{yy + 4:.1f}" text-anchor="end">'
                     f"{_n(top * frac)}</text>")
    for i, label in ((0, "−60 min"), (n // 2, "−30"), (n - 1, "now")):
        parts.append(f'<text x="{LEFT + (i + 0.5) * step:.1f}" y="{H - 4}" '
                     f'text-anchor="middle">{label}</text>')
    for i, m in enumerate(hour):
        base = 0.0
        for name, color, vs in bars:
            bar = vs[i] or 0
            if bar:
                parts.append(
                    f'<rect x="{LEFT + i * step + 0.5:.1f}" y="{y(base + bar):.1f}" '
                    f'width="{max(step - 1, 1):.1f}" height="{bar / top * ph:.1f}" '
                    f'fill="{color}"><title>{_clock(m.minute * 60)} {_e(name)}: '
                    f"{_n(bar)}{unit}</title></rect>")
                base += bar
    for name, color, vs in lines:
        path, pen = [], "M"
        for i, point in enumerate(vs):
            if point is None:
                pen = "M"
                continue
            path.append(f"{pen}{LEFT + (i + 0.5) * step:.1f},{y(point):.1f}")
            pen = "L"
        if path:
            parts.append(f'<path d="{" ".join(path)}" fill="none" stroke="{color}" '
                         f'stroke-width="2"><title>{_e(name)}</title></path>')
        for i, point in enumerate(vs):  # a dot per minute: a lone value is seen too
            if point is not None:
                parts.append(f'<circle cx="{LEFT + (i + 0.5) * step:.1f}" cy="{y(point):.1f}" '
                             f'r="2" fill="{color}"><title>{_clock(hour[i].minute * 60)} '
                             f"{_e(name)}: {_n(point)}{unit}</title></circle>")
    parts.append("</svg>")
    legend = "".join(f'<span><i class="sw" style="background:{c}"></i>{_e(name)}</span>'
                     for name, c, _ in (*bars, *lines))
    return f'<div><h2>{_e(title)}</h2>{"".join(parts)}<div class="legend">{legend}</div></div>'


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


# --------------------------------------------------------------------------- main page


def _pill(text: str, cls: str) -> str:
    return f'<span class="pill {cls}">{_e(text)}</span>'


def _flag(on: bool) -> str:
    return "true" if on else "false"


def _status_section(st: Status) -> str:
    rules = st.rules
    m = rules.memory
    b = m.budget
    mode_cls = {"on": "ok", "shadow": "warn", "off": "off"}[m.mode]
    rows = [
        ("switch", f'{_pill("eviction on" if m.enable_eviction else "eviction off", mode_cls)}'
                   f' mode <b id="mode" data-value="{m.mode}">{m.mode}</b>'
                   f" (enable_eviction: {_flag(m.enable_eviction)}, shadow: {_flag(m.shadow)})"),
        ("budget", '<span id="budget">' + " · ".join(
            f"{k} <b>{_n(v) if isinstance(v, int) else _e(v or '—')}</b>" for k, v in (
                ("max_tokens", b.max_tokens), ("max_chars", b.max_chars),
                ("max_messages", b.max_messages), ("max_turns", b.max_turns)))
            + f"</span> · order {_e(', '.join(m.eviction.order))}"),
        ("config", f'<span class="mono">{_e(rules.source)}</span>'),
    ]
    if st.process is not None:
        rows.append(("process", st.process.row()))
    last = st.last_reload
    if last is None:
        reload = "no reload since start"
    else:
        at, result, error = last
        reload = (f'{_pill(result, "ok" if result == "ok" else "bad")} '
                  f'<span id="reload-result" data-value="{_e(result)}"></span>'
                  f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(at))} UTC "
                  f'({_e(st.reload_trigger or "")}) <span class="mono">'
                  f'{_e(st.reload_file or "")}</span>'
                  + (f'<div class="err mono" id="reload-error">{_e(error)}</div>' if error else ""))
    rows.append(("last reload", f"{reload} · {st.reloads_ok} applied, "
                                f"{st.reloads_failed} refused since start"))
    for role, backend, s in st.backends:
        cls = "ok" if s.get("status") == "ok" else "bad"
        extra = f" · {s['errors']} errors" if s.get("errors") else ""
        if s.get("last_error"):
            extra += f' · last: <span class="mono">{_e(s["last_error"])}</span>'
        if role == "store" and not s.get("opened"):
            extra += " · not opened yet"
        rows.append((role, f'{_e(backend)} <span id="backend-{role}" data-value="'
                           f'{_e(s.get("status"))}">{_pill(str(s.get("status")), cls)}</span>'
                           f"{extra}"))
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<section><h2>Gateway</h2><table>{body}</table></section>"


def _hour_section(hour: Sequence[Minute]) -> str:
    req = sum(m.requests for m in hour)
    client = sum(m.client_tokens for m in hour)
    fwd = sum(m.forwarded_tokens for m in hour)
    have_usage = sum(m.usage_requests for m in hour)
    u_in = sum(m.usage_in for m in hour) if have_usage else None
    u_cached = sum(m.usage_cached for m in hour) if have_usage else None
    u_out = sum(m.usage_out for m in hour) if have_usage else None
    share = u_cached / u_in if u_in and u_cached is not None else None
    samples = [v for m in hour for v in m.overhead]
    stages = sorted({s for m in hour for s in m.dropped})
    cards = [
        _fig("requests", "requests", req),
        _fig("client-tokens", "tokens clients sent (est.)", client),
        _fig("forwarded-tokens", "tokens forwarded (est.)", fwd),
        _fig("saved", "share saved", round(1 - fwd / client, 4) if client else None),
        _fig("usage-in", "tokens provider reported (in)", u_in),
        _fig("usage-cached", "of those cached", u_cached),
        _fig("cached-share", "cached share", round(share, 4) if share is not None else None),
        _fig("usage-out", "output tokens (provider)", u_out),
        _fig("over-budget", "over budget", sum(m.over_budget for m in hour)),
        _fig("fallback", "fallbacks to the original", sum(m.fallback for m in hour)),
        _fig("errors", "answers ≥ 400", sum(m.errors for m in hour)),
        _fig("overhead-p50", "overhead p50 ms", percentile(samples, 0.5)),
        _fig("overhead-p99", "overhead p99 ms", percentile(samples, 0.99)),
        *(_fig(f"dropped-{s}", f"messages dropped by {s}",
               sum(m.dropped.get(s, 0) for m in hour)) for s in stages),
    ]
    per = [(m.overhead, m) for m in hour]
    charts = [
        chart("Requests per minute", hour, bars=[
            ("requests", "#94a3b8", [m.requests for m in hour])], lines=[
            ("over budget", "#dc2626", [m.over_budget or None for m in hour]),
            ("fallback", "#d97706", [m.fallback or None for m in hour]),
            ("answers ≥ 400", "#7c3aed", [m.errors or None for m in hour])]),
        chart("Tokens per minute", hour, lines=[
            ("clients sent", "#64748b", [m.client_tokens if m.requests else None for m in hour]),
            ("forwarded", "#16a34a", [m.forwarded_tokens if m.requests else None for m in hour]),
            ("provider reported", "#2563eb",
             [m.usage_in if m.usage_requests else None for m in hour]),
            ("provider cached", "#0891b2",
             [m.usage_cached if m.usage_requests else None for m in hour])]),
        chart("Messages dropped per minute, by stage (in shadow: would drop)", hour, bars=[
            (s, STAGE_COLORS.get(s, "#ef4444"), [m.dropped.get(s, 0) for m in hour])
            for s in stages]),
        chart("Gateway overhead per minute (ms)", hour, lines=[
            ("p50", "#16a34a", [percentile(v, 0.5) for v, _ in per]),
            ("p99", "#dc2626", [percentile(v, 0.99) for v, _ in per])], unit=" ms"),
    ]
    return (f'<section><h2>Last hour</h2><div class="cards">{"".join(cards)}</div></section>'
            f'<section><div class="grid">{"".join(charts)}</div></section>')


def session_url(sid: str, tenant: str = "") -> str:
    """A session's page: the id and its tenant, since two tenants may share an id."""
    t = f"&t={quote(tenant, safe='')}" if tenant else ""
    return f"/admin/console/session?id={quote(sid, safe='')}{t}"


def session_link(sid: str, tenant: str = "") -> str:
    return f'<a href="{_e(session_url(sid, tenant))}">{_e(sid)}</a>'


def _sessions_section(largest: Sequence[tuple[tuple[str, str], SessionLog]]) -> str:
    if not largest:
        return "<section><h2>Sessions</h2><p>No requests seen yet.</p></section>"
    head = ("<tr><th>session</th><th>tenant</th><th class=num>requests</th><th class=num>turn</th>"
            "<th class=num>messages</th><th class=num>est. tokens</th><th class=num>forwarded"
            "</th><th>evict</th><th>cut</th><th class=num>prefix tokens</th><th>last seen</th>"
            "</tr>")
    rows = []
    for (tenant, sid), log in largest:
        s = log.ring[-1]
        f = s.fields
        rows.append(
            f'<tr class="session-row" data-session="{_e(sid)}" data-tenant="{_e(tenant)}">'
            f"<td>{session_link(sid, tenant)}</td>"
            f'<td class="mono">{_e(tenant or "—")}</td>'
            f"<td class=num>{log.requests}</td><td class=num>{_n(f.get('turn'))}</td>"
            f"<td class=num>{_n(f.get('hist_msgs'))}</td>"
            f'<td class=num data-value="{_e(f.get("est_tokens", ""))}">'
            f"{_n(f.get('est_tokens'))}</td><td class=num>{_n(s.forwarded_tokens)}</td>"
            f"<td>{_e(f.get('evict', ''))}</td><td>{_e(f.get('cut', '—'))}</td>"
            f"<td class=num>{_n(f.get('prefix_tokens'))}</td><td>{_clock(s.at, True)}</td></tr>")
    return (f"<section><h2>Sessions with the largest histories</h2><table>{head}"
            f'{"".join(rows)}</table></section>')


def main_page(st: Status, hour: Sequence[Minute],
              largest: Sequence[tuple[tuple[str, str], SessionLog]],
              rules: ConsoleRules, refresh_s: int = REFRESH_S) -> str:
    return _doc("memgate console", _status_section(st) + _hour_section(hour)
                + _sessions_section(largest) + _footer(rules, refresh_s, st.process),
                refresh_s)


def _footer(rules: ConsoleRules, refresh_s: int, process: Process | None) -> str:
    again = (f"refreshes every {refresh_s} s (<a href='?refresh=0'>stop</a>)" if refresh_s
             else f"<a href='?refresh={REFRESH_S}'>refresh every {REFRESH_S} s</a>")
    who = f"{_e(process.footer())} · " if process is not None else ""
    return (f'<p class="mono" id="footer">{who}times UTC · {again} · '
            f"keeps {rules.max_sessions} sessions × {rules.ring} requests · text "
            f"{'shown' if rules.show_text else 'hidden'}</p>")


# --------------------------------------------------------------------------- one session


def _kind_color(kind: str) -> str:
    if kind.startswith("drop:"):
        return STAGE_COLORS.get(kind[5:], "#ef4444")
    return KIND_COLORS.get(kind, "#cbd5e1")


def _kind_name(kind: str, shadow: bool) -> str:
    if kind.startswith("drop:"):
        return f"{'would drop' if shadow else 'dropped'} ({kind[5:]})"
    return kind


def strip_svg(seen: Seen) -> str:
    """A request's messages left to right, one colour per kind."""
    total = sum(c for _, c, _ in seen.strip)
    if not total:
        return "<p>no messages</p>"
    shadow = seen.fields.get("mode") != "on"
    width = 1000
    rects = []
    for first, count, kind in seen.strip:
        x, w = first / total * width, max(count / total * width, 0.6)
        span = f"{first}" if count == 1 else f"{first}–{first + count - 1}"
        rects.append(f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="18" '
                     f'fill="{_kind_color(kind)}" data-kind="{_e(kind)}" data-count="{count}">'
                     f"<title>messages {span} ({count}): {_e(_kind_name(kind, shadow))}"
                     "</title></rect>")
    current = next((first for first, _, kind in seen.strip if kind == "current"), None)
    if seen.note_chars is not None and current is not None:  # where the note is inserted
        rects.append(f'<rect x="{max(current / total * width - 2, 0):.2f}" y="0" width="3" '
                     f'height="18" fill="#0f172a"><title>carry note, {seen.note_chars} '
                     "characters, inserted before the current turn</title></rect>")
    return (f'<svg class="strip" viewBox="0 0 {width} 18" width="100%" height="18" '
            f'preserveAspectRatio="none">'
            f'{"".join(rects)}</svg>')


def _strip_legend(shadow: bool) -> str:
    kinds = [*KIND_COLORS.items(), *((f"{'would drop' if shadow else 'dropped'} ({s})", c)
                                    for s, c in STAGE_COLORS.items())]
    return '<div class="legend">' + "".join(
        f'<span><i class="sw" style="background:{c}"></i>{_e(k)}</span>' for k, c in kinds
        if k != "more") + "</div>"


_ROW = (("kept", "kept"), ("dropped", "dropped"), ("would_drop", "would drop"),
        ("pinned", "pinned"), ("compacted", "compacted"), ("recalled", "recalled msgs"),
        ("recalled_records", "recalled records"), ("carried", "carried fields"),
        ("cut", "cut"), ("prefix_tokens", "prefix tokens"), ("est_tokens", "est. tokens"),
        ("budget_tokens", "budget"), ("usage_in", "provider in"),
        ("usage_cached", "provider cached"), ("usage_out", "provider out"),
        ("overhead_ms", "overhead ms"), ("upstream_ms", "upstream ms"))


def _request(seen: Seen) -> str:
    f = seen.fields
    head = (f'<span class="mono">{_clock(seen.at, True)}</span> req <span class="mono">'
            f'{_e(f.get("req", ""))}</span> · {_n(f.get("hist_msgs"))} messages · '
            f'{_e(seen.model or "—")} · status '
            f'{_e(f.get("status", ""))} · mode {_e(f.get("mode", ""))} · evict '
            f'{_e(f.get("evict", ""))}'
            + (f' (would: {_e(f["would_evict"])})' if "would_evict" in f else "")
            + (f' · {_pill("over budget", "bad")}' if f.get("over_budget") else "")
            + (f' · {_pill("fallback: original", "warn")}' if "fallback" in f else "")
            + (f' · skipped: {_e(f["reason"])}' if "reason" in f else ""))
    cells = [f'<span data-field="{k}" data-value="{_e(f[k])}">{_e(label)} <b>'
             f"{_e(f[k]) if isinstance(f[k], str) else _n(f[k])}</b></span>"
             for k, label in _ROW if k in f]
    cells.insert(1, f'<span data-field="forwarded_tokens" data-value="'
                    f'{seen.forwarded_tokens}">forwarded tokens <b>'
                    f"{_n(seen.forwarded_tokens)}</b></span>")
    note = ""
    if seen.note_chars is not None:
        note = (f'<div>carry note: <b data-field="note_chars" data-value="{seen.note_chars}">'
                f"{_n(seen.note_chars)}</b> characters"
                + (f"<pre>{_e(seen.note)}</pre>" if seen.note is not None else "") + "</div>")
    records = ""
    if seen.records:
        records = ("<div>recalled records: " + ", ".join(f"{n:,} chars" for n in seen.records)
                   + "".join(f"<pre>{_e(t)}</pre>" for t in seen.record_texts) + "</div>")
    return (f'<div class="req" data-req="{_e(f.get("req", ""))}"><div>{head}</div>'
            f'{strip_svg(seen)}<div class="kvs">{"".join(cells)}</div>{note}{records}</div>')


def session_page(sid: str, log: SessionLog, rules: ConsoleRules,
                 refresh_s: int = REFRESH_S, tenant: str = "",
                 process: Process | None = None) -> str:
    shadow = log.ring[-1].fields.get("mode") != "on"
    reqs = "".join(_request(s) for s in reversed(log.ring))
    body = (f'<section><h2>Session <span class="mono" id="session">{_e(sid)}</span></h2>'
            f'<p>tenant <span class="mono" id="tenant">{_e(tenant or "— (no credential)")}'
            "</span></p>"
            f"<p>{log.requests} requests seen, the last {len(log.ring)} below (newest first). "
            "Each strip is one request's messages in the client's order, first to last "
            "(recalled ones are forwarded just before the current turn; a dark mark: where "
            "the carry note went).</p>"
            f"{_strip_legend(shadow)}{reqs}</section>{_footer(rules, refresh_s, process)}")
    return _doc(f"memgate console: {sid}", body, refresh_s)
