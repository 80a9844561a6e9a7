"""The operator console: its bounded memory, its config, its admin gate and its pages."""

from __future__ import annotations

import asyncio
import re
from html import unescape
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.config.schema import ConsoleRules
from gateway.errors import RulesError
from gateway.observe import console_view as view
from gateway.observe.console_log import Console, message_strip
from tests.conftest import SECRET, GatewayFactory, Upstream, write_config
from tests.policy.test_policy_properties import SETTINGS, make_rules, run
from tests.strategies import conversation, memory_rules

TOKEN = "adm-" + SECRET[::-1]
ADMIN = {"X-Memgate-Admin-Token": TOKEN}
BUDGET = {"max_tokens": 1200, "max_chars": None, "max_messages": None, "max_turns": None}


def expanded(strip: tuple[tuple[int, int, str], ...]) -> list[str]:
    return [kind for _, count, kind in strip for _ in range(count)]


@pytest.mark.slow
@given(msgs=conversation(), memory=memory_rules(), shadow=st.booleans())
@settings(max_examples=min(SETTINGS.max_examples, 40))  # the planner's own properties run more
def test_strip_is_the_plan_message_by_message(msgs: list[dict[str, Any]],
                                              memory: dict[str, Any], shadow: bool) -> None:
    """The strip covers every message once, in order: each kept one by why it was kept,
    each dropped one by the stage that dropped it; the per-stage counts are the plan's."""
    if shadow:
        memory = {**memory, "enable_eviction": False, "shadow": True}
    d = run(msgs, make_rules(memory))
    strip, dropped = message_strip(d)
    assert [first for first, _, _ in strip] == [
        sum(c for _, c, _ in strip[:k]) for k in range(len(strip))]
    kinds = expanded(strip)
    assert len(kinds) == len(msgs)
    p = d.plan
    assert p is not None
    want = ["kept"] * len(msgs)
    if p.kept_by[:1] != ("fits",) or p.dropped:
        for i, by in zip(p.kept, p.kept_by):
            want[i] = ("compacted" if i in d.compacted else
                       by if by in ("system", "current", "pinned", "recalled") else "kept")
    for i, stage in p.dropped:
        want[i] = f"drop:{stage}"
    assert kinds == want
    listed: dict[str, int] = {}
    for _, stage in p.dropped:
        listed[stage] = listed.get(stage, 0) + 1
    assert dropped == listed


def fields(session: str, req: str, est: int = 100, **more: Any) -> dict[str, Any]:
    return {"session": session, "req": req, "est_tokens": est, "mode": "on", "status": 200,
            "overhead_ms": 1.0, "evict": "none", "kept": 3, "dropped": 0, **more}


def test_sessions_and_rings_are_bounded() -> None:
    """At most max_sessions sessions (the least recently seen forgotten first), each with
    its last `ring` requests; a reload that narrows the bounds trims what is kept."""
    c = Console(ConsoleRules(enabled=True, max_sessions=3, ring=2), clock=lambda: 1_000_000.0)
    for k in range(5):
        for r in range(4):
            c.observe(fields(f"s{k}", f"r{k}-{r}", est=10 * k), None, None)
    c.observe(fields("s2", "again"), None, None)  # s2 becomes the most recent
    assert list(c.sessions) == [("", "s3"), ("", "s4"), ("", "s2")]  # no tenant: ""
    assert [s.fields["req"] for s in c.sessions[("", "s4")].ring] == ["r4-2", "r4-3"]
    assert c.sessions[("", "s4")].requests == 4
    c.configure(ConsoleRules(enabled=True, max_sessions=2, ring=1))
    assert list(c.sessions) == [("", "s4"), ("", "s2")]
    assert [s.fields["req"] for s in c.sessions[("", "s2")].ring] == ["again"]
    assert sum(m.requests for m in c.hour()) == 21


def test_minutes_keep_the_last_hour_only() -> None:
    """A request older than an hour leaves the figures; overhead samples per minute stay
    bounded however many requests a minute brings."""
    now = [0.0]
    c = Console(ConsoleRules(enabled=True), clock=lambda: now[0])
    now[0] = 60.0 * 1000
    c.observe(fields("a", "old", est=7), None, None)
    now[0] += 3600
    for k in range(2000):
        c.observe(fields("a", f"n{k}", est=1, overhead_ms=float(k)), None, None)
    hour = c.hour()
    assert len(hour) == 60 and sum(m.requests for m in hour) == 2000
    assert sum(m.client_tokens for m in hour) == 2000
    assert max(len(m.overhead) for m in hour) <= 512


@pytest.mark.parametrize("console, reason", [
    ({"enabled": "yes"}, "must be true or false"),
    ({"max_sessions": 0}, "must be between 1 and 10000"),
    ({"ring": 10_000}, "must be between 1 and 500"),
    ({"show_txt": True}, "unknown key"),
])
def test_bad_console_config_is_refused(console: dict[str, Any], reason: str) -> None:
    """Every console key is validated; an unknown one is named."""
    with pytest.raises(RulesError, match=reason):
        build_rules({"console": console})


def test_console_defaults_are_off() -> None:
    """Off by default: nothing observed, no text."""
    assert build_rules({}).console == ConsoleRules(enabled=False, show_text=False)


async def test_off_registers_nothing_and_a_reload_switches_it(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """console.enabled false: no observer, the page is a 404; a reload that enables it
    registers one observer (serving from then on), disabling removes it again."""
    gw = await gateway(env={"MEMGATE_ADMIN_TOKEN": TOKEN})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
            assert r.status == 404 and "console.enabled" in await r.text()
        assert gw.state.console is None and gw.state.observers == []
        for enabled in (True, False):
            write_config(gw.config, console={"enabled": enabled})
            assert await gw.state.reloader.reload("test")
            assert (gw.state.console is not None) is enabled
            assert len(gw.state.observers) == int(enabled)
            async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
                assert r.status == (200 if enabled else 404)


async def test_the_admin_gate(gateway: GatewayFactory) -> None:
    """No token configured: 404. Configured: 401 with a sign-in form, the header or the
    form's HttpOnly SameSite=Strict cookie (not the token itself) let in, a wrong token
    does not, and signing out clears the cookie."""
    gw = await gateway(console={"enabled": True})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
            assert r.status == 404 and "MEMGATE_ADMIN_TOKEN" in await r.text()
    gw = await gateway(console={"enabled": True}, env={"MEMGATE_ADMIN_TOKEN": TOKEN})
    # the jar keeps a cookie of an IP address host only when told it may
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        async with s.get(f"{gw.url}/admin/console") as r:
            page = await r.text()
            assert r.status == 401 and 'name="token"' in page
            assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
        async with s.get(f"{gw.url}/admin/console", headers={
                "X-Memgate-Admin-Token": "wrong"}) as r:
            assert r.status == 401
        async with s.post(f"{gw.url}/admin/console/login", data={"token": "wrong"}) as r:
            assert r.status == 401 and "Wrong admin token" in await r.text()
            assert "memgate_console" not in r.cookies
        async with s.post(f"{gw.url}/admin/console/login", data={"token": TOKEN}) as r:
            assert r.status == 200
            cookie = r.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            assert "Path=/admin/console" in cookie and TOKEN not in cookie
        async with s.get(f"{gw.url}/admin/console") as r:  # the cookie jar sends it
            assert r.status == 200 and "Last hour" in await r.text()
        async with s.post(f"{gw.url}/admin/console/logout") as r:
            assert r.status == 200
        async with s.get(f"{gw.url}/admin/console") as r:
            assert r.status == 401
        async with s.post(f"{gw.url}/admin/console/login", data=b"token=" + b"x" * 5000,
                          headers={"Content-Type": "application/x-www-form-urlencoded"}) as r:
            assert r.status == 413


async def _chat(s: aiohttp.ClientSession, gw: Any, session: str, msgs: list[dict[str, Any]],
                ) -> None:
    async with s.post(f"{gw.url}/v1/chat/completions",
                      data=orjson.dumps({"model": "gpt-4o-mini", "messages": msgs}),
                      headers={"Authorization": f"Bearer {SECRET}",
                               "X-Session-Id": session}) as r:
        assert r.status == 200


def _history(turns: int, secret_word: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"{secret_word} question {t} " + "pad " * 60},
                 {"role": "assistant", "content": f"answer {t} " + "pad " * 60}]
    return [*msgs, {"role": "user", "content": f"{secret_word} and now?"}]


async def test_text_only_with_show_text_and_ids_escaped(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Default: the note's size, never its text nor any message text; show_text shows the
    note. A session's link from the table (its id quoted) opens its page."""
    from tests.conftest import ROOT
    from tests.policy.test_carry import long_session

    carry = {"enabled": True, "rules_file": str(ROOT / "rules" / "carry.yaml")}
    sid = "team/a@b:1.x"
    for show in (False, True):
        gw = await gateway(memory={"enable_eviction": True, "budget": BUDGET, "carry": carry},
                           console={"enabled": True, "show_text": show},
                           env={"MEMGATE_ADMIN_TOKEN": TOKEN})
        async with aiohttp.ClientSession() as s:
            await _chat(s, gw, sid, long_session())
            (ev,) = await gw.wait_mem(1)
            async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
                main = await r.text()
            link = re.search(r'href="(/admin/console/session\?id=[^"]+)"', main)
            assert link is not None
            url = unescape(link[1])
            assert url.startswith("/admin/console/session?id=team%2Fa%40b%3A1.x&t=t-")
            async with s.get(f"{gw.url}{url}", headers=ADMIN) as r:
                assert r.status == 200
                one = await r.text()
        assert f'<span class="mono" id="session">{sid}</span>' in one
        for html in (main, one):
            assert SECRET not in html and TOKEN not in html
            assert "Status check" not in html  # message text
        note = upstream.last_body()["messages"][-2]["content"]
        assert note.startswith("[memgate memory]")
        assert re.search(rf'data-field="note_chars" data-value="{len(note)}"', one)
        assert ("/data/orders" in one) is show  # the note's text, only when allowed
        assert int(ev["dropped"]) > 0


def test_client_strings_are_escaped() -> None:
    """Whatever a client named (a session id, a model) reaches the page escaped."""
    evil = '<img src=x onerror="alert(1)">&'
    c = Console(ConsoleRules(enabled=True), clock=lambda: 1_000_000.0)
    c.observe({**fields(evil, evil), "model": evil}, None, None)
    log = c.sessions[("", evil)]
    for html in (view.session_page(evil, log, c.rules),
                 view.session_link(evil)):
        assert evil not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html


def _figures(html: str) -> dict[str, str]:
    return dict(re.findall(r'id="fig-([a-z0-9_-]+)" data-value="([^"]*)"', html))


def test_provider_usage_and_cached_share() -> None:
    """The provider's own counts (usage_in / usage_cached / usage_out on the [mem] fields)
    are summed over the hour, with the cached share; requests without them count nothing
    there, and with none at all the figures are empty (—)."""
    c = Console(ConsoleRules(enabled=True), clock=lambda: 1_000_000.0)
    status = view.Status(build_rules({}), None, None, None, 0, 0, [])
    c.observe(fields("a", "1"), None, None)
    assert _figures(view.main_page(status, c.hour(), c.largest(), c.rules))["usage-in"] == ""
    c.observe(fields("a", "2", usage_in=1000, usage_cached=600, usage_out=50), None, None)
    c.observe(fields("b", "3", usage_in=3000, usage_cached=0, usage_out=70), None, None)
    figs = _figures(view.main_page(status, c.hour(), c.largest(), c.rules))
    assert (figs["requests"], figs["usage-in"], figs["usage-cached"], figs["usage-out"]) == (
        "3", "4000", "600", "120")
    assert float(figs["cached-share"]) == pytest.approx(0.15)


async def test_a_refused_reload_is_shown_with_its_file_and_error(
    gateway: GatewayFactory,
) -> None:
    """The last reload's result, trigger, file and error reach the page; the good one
    applied after it replaces them."""
    gw = await gateway(console={"enabled": True}, env={"MEMGATE_ADMIN_TOKEN": TOKEN})
    gw.config.write_text("console:\n  ring: 0\n", encoding="utf-8")
    assert not await gw.state.reloader.reload("sighup")
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
            page = await r.text()
        assert 'id="reload-result" data-value="failed"' in page and "(sighup)" in page
        assert str(gw.config) in page and "console.ring" in page
        write_config(gw.config, console={"enabled": True, "ring": 5})
        assert await gw.state.reloader.reload("watch")
        async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
            page = await r.text()
        assert 'id="reload-result" data-value="ok"' in page and "reload-error" not in page
        assert gw.state.console is not None and gw.state.console.rules.ring == 5


async def test_remote_callers_are_refused_unless_opened(gateway: GatewayFactory) -> None:
    """As the admin API: a caller from another host gets a 403 (even with the right
    token), unless MEMGATE_ADMIN_ALLOW_REMOTE=1."""
    from unittest.mock import Mock

    from aiohttp.test_utils import make_mocked_request

    from gateway.proxy import console

    for allow, want in (("", 403), ("1", 200)):
        gw = await gateway(console={"enabled": True},
                           env={"MEMGATE_ADMIN_TOKEN": TOKEN, "MEMGATE_ADMIN_ALLOW_REMOTE": allow})
        peer = Mock()  # the socket a request came in on: aiohttp reads the peer from it
        peer.get_extra_info.side_effect = lambda k, d=None: ("10.1.2.3", 40000) \
            if k == "peername" else d
        req = make_mocked_request("GET", "/admin/console", headers=ADMIN, app=gw.app,
                                  transport=peer)
        assert req.remote == "10.1.2.3"
        resp = await console.page(req)
        assert resp.status == want


async def test_two_tenants_sharing_a_session_id_are_two_sessions(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """Two keys (the openai SDK) and a keyless caller sending the same X-Session-Id are
    three rows, each tenant's link opening only that tenant's requests; the tenant shown
    is the `t-<16 hex>` hash, never a key."""
    import openai

    gw = await gateway(console={"enabled": True}, env={"MEMGATE_ADMIN_TOKEN": TOKEN})
    keys = ("sk-tenant-A-" + SECRET, "sk-tenant-B-" + SECRET)
    sent: dict[str, list[str]] = {}
    for n, key in enumerate(keys):
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key,
                                      max_retries=0) as c:
            for r in range(n + 1):  # A sends one request, B two
                rid = f"k{n}-r{r}"
                await c.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi " * (r + 1)}],
                    extra_headers={"X-Session-Id": "shared", "X-Request-Id": rid})
                sent.setdefault(key, []).append(rid)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{gw.url}/v1/chat/completions", data=orjson.dumps(
                {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
                headers={"X-Session-Id": "shared", "X-Request-Id": "anon"}) as r:
            assert r.status == 200
        await gw.wait_mem(4)
        async with s.get(f"{gw.url}/admin/console", headers=ADMIN) as r:
            main = await r.text()
        rows = re.findall(r'class="session-row" data-session="shared" data-tenant="([^"]*)"',
                          main)
        assert len(rows) == 3 and len(set(rows)) == 3 and "" in rows
        tenants = [t for t in rows if t]
        assert all(re.fullmatch(r"t-[0-9a-f]{16}", t) for t in tenants)
        for key in keys:
            assert key not in main
        seen: dict[str, list[str]] = {}
        for href in re.findall(r'href="(/admin/console/session\?id=shared[^"]*)"', main):
            async with s.get(f"{gw.url}{unescape(href)}", headers=ADMIN) as r:
                assert r.status == 200
                one = await r.text()
            tenant = re.search(r'id="tenant">([^<]*)<', one)
            assert tenant is not None
            seen[tenant[1]] = re.findall(r'class="req[^"]*" data-req="([^"]+)"', one)
        async with s.get(f"{gw.url}/admin/console/session?id=shared&t=t-0000000000000000",
                         headers=ADMIN) as r:
            assert r.status == 404  # a tenant that never sent it: nothing
    assert sorted(len(v) for v in seen.values()) == [1, 1, 2]
    assert sorted(seen[t] for t in tenants) == sorted(
        list(reversed(v)) for v in sent.values())  # newest first
    assert [v for t, v in seen.items() if t not in tenants] == [["anon"]]


async def console_page(port: int, path: str = "/admin/console") -> tuple[int, str]:
    """(status, body) of a console page got on a new connection (the kernel picks the
    worker)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 f"X-Memgate-Admin-Token: {TOKEN}\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


@pytest.mark.slow
async def test_with_workers_each_page_says_which_worker_it_shows(
        upstream: Upstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --workers 2`: every page names the worker that rendered it (index and pid,
    as its log lines do) and says it shows that worker's requests only, and it does: a
    worker's page counts the requests of its own [mem] lines."""
    from tests.proxy.test_workers import client, mem_events, start_workers, wait_log, workers_of

    monkeypatch.setenv("MEMGATE_ADMIN_TOKEN", TOKEN)
    cfg = write_config(tmp_path / "gateway.yaml", console={"enabled": True})
    proc, port, log = await start_workers(upstream.url, tmp_path, cfg)
    try:
        pids = {pid: w for w, pid in workers_of(log.read_text()).items()}
        sdk = client(port)
        for i in range(12):
            await sdk.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": f"q {i}"}],
                extra_headers={"X-Session-Id": "shared"})
        await sdk.close()
        mems = mem_events(await wait_log(log, lambda t: len(mem_events(t)) >= 12, proc))
        per_worker = {w: sum(m["worker"] == w for m in mems) for w in ("0", "1")}
        seen: dict[str, str] = {}
        for _ in range(60):  # new connections until both workers rendered a page
            status, page = await console_page(port)
            pid = re.search(r'id="pid" data-value="(\d+)"', page)
            worker = re.search(r'id="worker" data-value="(\d+)"', page)
            assert status == 200 and pid and worker, page
            assert pids[int(pid.group(1))] == worker.group(1)  # as its log lines say
            assert "of 2 (pid" in page and "this worker only" in page
            assert f"worker {worker.group(1)} of 2, pid {pid.group(1)}: its requests only" \
                in page
            seen[worker.group(1)] = page
            if len(seen) == 2:
                break
        assert set(seen) == {"0", "1"}
        for w, page in seen.items():
            assert _figures(page)["requests"] == str(per_worker[w]), w
        link = re.search(r'href="(/admin/console/session\?[^"]+)"', seen["0"])
        assert link is not None
        for _ in range(20):  # a worker that answered some of the session's requests
            status, page = await console_page(port, unescape(link.group(1)))
            if status == 200:
                assert re.search(r"worker [01] of 2, pid \d+: its requests only", page)
                break
        assert status == 200
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
