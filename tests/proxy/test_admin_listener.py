"""listen.admin_port: /metrics and /admin/* on a listener of their own, and /metrics
hygiene (no _created series, process metrics, bounded label sets present at 0).

The listeners are started the way `memgate serve` starts them (GatewayRunner, a main
TCPSite, then listeners.start_admin_site on the same runner), on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.rules import load_rules
from gateway.observe import logging as mglog
from gateway.observe.metrics import MODES, ROUTES
from gateway.observe.relayed import REFUSALS
from gateway.proxy.app import create_app
from gateway.proxy.httpserver import GatewayRunner
from gateway.proxy.listeners import ADMIN_LISTEN, start_admin_site
from tests.conftest import SECRET, Upstream, write_config
from tests.perf.bench_gateway import free_port

ADMIN_TOKEN = "admin-token-0123456789"


@dataclass
class Listening:
    main: str
    admin: str
    app: web.Application
    runner: web.AppRunner
    log: io.StringIO


@contextlib.asynccontextmanager
async def listening(tmp_path: Path, upstream_url: str, admin_port: int | None = None,
                    main_port: int = 0, reuse_port: bool | None = None,
                    name: str = "gateway.yaml") -> AsyncIterator[Listening]:
    """A gateway with listen.admin_port, both sites bound as `serve_forever` binds them."""
    port = admin_port or free_port()
    cfg = write_config(tmp_path / name, listen={"admin_port": port})
    env = {"MEMGATE_UPSTREAM": upstream_url, "MEMGATE_ANTHROPIC_UPSTREAM": upstream_url,
           "MEMGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    stream = io.StringIO()
    mglog.configure("console", "info", stream=stream)
    app = create_app(load_rules(cfg, env), cfg, env, watch_interval_s=60)
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        main = web.TCPSite(runner, "127.0.0.1", main_port, reuse_port=reuse_port)
        await main.start()
        admin = await start_admin_site(runner, main, app[ADMIN_LISTEN])
        assert admin is not None
        bound = main._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield Listening(f"http://127.0.0.1:{bound}", f"http://127.0.0.1:{port}", app, runner,
                        stream)
    finally:
        await runner.cleanup()


async def get(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        raw = await r.read()
        try:
            return r.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return r.status, raw.decode()


async def test_admin_port_moves_metrics_and_admin_routes(
    tmp_path: Path, upstream: Upstream
) -> None:
    """The SDKs' traffic goes through the main port; /metrics and /admin/* answer only on
    the admin port (404 in the API's shape on the main one, never relayed), and the admin
    port answers probes but relays nothing, not even a chat call."""
    async with listening(tmp_path, upstream.url) as gw:
        async with openai.AsyncOpenAI(base_url=f"{gw.main}/v1", api_key=SECRET,
                                      max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "hello from upstream"
        relayed = len(upstream.received)

        code, body = await get(f"{gw.main}/metrics")
        assert code == 404 and body["error"]["code"] == "wrong_listener"
        code, body = await get(f"{gw.main}/admin/sessions/s1/memory",
                               headers={"X-Memgate-Admin-Token": ADMIN_TOKEN})
        assert code == 404 and body["error"]["code"] == "wrong_listener"
        assert len(upstream.received) == relayed  # refused here, not sent to the provider

        code, text = await get(f"{gw.admin}/metrics")
        assert code == 200
        assert 'memgate_requests_total{mode="shadow",route="openai_chat",status="200"} 1.0' \
            in text.splitlines()
        assert SECRET not in text
        code, body = await get(f"{gw.admin}/admin/sessions/s1/memory",
                               headers={"X-Memgate-Admin-Token": ADMIN_TOKEN})
        # the route itself answers (its own 404: the session has no carry snapshot)
        assert code == 404 and body["error"]["code"] == "not_found", body
        for probe in ("/healthz", "/readyz"):
            assert (await get(f"{gw.main}{probe}"))[0] == 200
            assert (await get(f"{gw.admin}{probe}"))[0] == 200

        async with openai.AsyncOpenAI(base_url=f"{gw.admin}/v1", api_key=SECRET,
                                      max_retries=0) as on_admin:
            with pytest.raises(openai.NotFoundError) as caught:
                await on_admin.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
        assert caught.value.code == "wrong_listener"
        async with anthropic.AsyncAnthropic(base_url=gw.admin, api_key=SECRET,
                                            max_retries=0) as claude:
            with pytest.raises(anthropic.NotFoundError) as refused:
                await claude.messages.create(model="claude-3-5-haiku-20241022", max_tokens=10,
                                             messages=[{"role": "user", "content": "hi"}])
        assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        async with aiohttp.ClientSession() as s, s.post(f"{gw.admin}/metrics", data=b"x") as r:
            assert r.status == 404  # the catch-all relay is not on this listener
        assert len(upstream.received) == relayed


async def test_admin_site_shares_the_main_sites_reuse_port(
    tmp_path: Path, upstream: Upstream
) -> None:
    """Two processes of `serve --workers N` bind the same ports: the admin site is bound
    with the main site's reuse_port, so a second gateway on both ports starts, and both
    listeners answer."""
    admin_port, main_port = free_port(), free_port()
    async with listening(tmp_path, upstream.url, admin_port, main_port, reuse_port=True) as a, \
            listening(tmp_path, upstream.url, admin_port, main_port, reuse_port=True,
                      name="second.yaml") as b:
        assert (a.main, a.admin) == (b.main, b.admin)
        assert (await get(f"{a.admin}/metrics"))[0] == 200
        assert (await get(f"{a.main}/metrics"))[0] == 404


async def test_metrics_hygiene_over_http(tmp_path: Path, upstream: Upstream) -> None:
    """A fresh gateway's /metrics: valid exposition text, no `_created` series, the
    process's CPU and memory, and every bounded label set at 0 before any request; one
    request moves exactly its own child."""
    async with listening(tmp_path, upstream.url) as gw:
        code, before = await get(f"{gw.admin}/metrics")
        assert code == 200
        assert not [ln for ln in before.splitlines() if "_created" in ln]
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(before) for s in fam.samples}
        names = {name for name, _ in samples}
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes",
                "process_open_fds"} <= names
        assert samples[("process_resident_memory_bytes", ())] > 0
        for route in ROUTES:
            for mode in MODES:
                key = (("mode", mode), ("route", route), ("status", "200"))
                assert samples[("memgate_requests_total", key)] == 0
            for status in REFUSALS:
                assert samples[("memgate_fallback_total",
                                (("route", route), ("status", str(status))))] == 0
            for hist in ("memgate_history_tokens_before", "memgate_gateway_overhead_seconds",
                         "memgate_dropped_messages"):
                assert samples[(f"{hist}_count", (("route", route),))] == 0
            assert samples[("memgate_relayed_bytes_total", (("route", route),))] == 0
        for result in ("ok", "failed"):
            assert samples[("memgate_config_reloads_total", (("result", result),))] == 0

        async with anthropic.AsyncAnthropic(base_url=gw.main, api_key=SECRET,
                                            max_retries=0) as claude:
            await claude.messages.create(model="claude-3-5-haiku-20241022", max_tokens=10,
                                         messages=[{"role": "user", "content": "hi"}])
        _, after_text = await get(f"{gw.admin}/metrics")
        after = {(s.name, tuple(sorted(s.labels.items()))): s.value
                 for fam in text_string_to_metric_families(after_text) for s in fam.samples}
        moved = {k for k in samples if k[0].startswith("memgate_requests_total")
                 and after.get(k) != samples[k]}
        assert moved == {("memgate_requests_total", (("mode", "shadow"),
                                                     ("route", "anthropic_messages"),
                                                     ("status", "200")))}


# --------------------------------------------------------------------------- property


class Threaded:
    """A gateway with an admin port and a counting upstream on their own loop and
    thread, for a hypothesis property over plain http.client requests."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.relayed = tmp, 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.ports: tuple[int, int] = (0, 0)
        self.runners: list[web.AppRunner] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _upstream(self, request: web.Request) -> web.Response:
        await request.read()
        self.relayed += 1
        return web.json_response({"object": "list", "data": []})

    async def _start(self) -> None:
        up = web.Application()
        up.router.add_route("*", "/{tail:.*}", self._upstream)
        up_runner = web.AppRunner(up)
        await up_runner.setup()
        site = web.TCPSite(up_runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore
        admin_port = free_port()
        cfg = write_config(self.tmp / "gateway.yaml", listen={"admin_port": admin_port})
        env = {"MEMGATE_UPSTREAM": url, "MEMGATE_ANTHROPIC_UPSTREAM": url}
        mglog.configure("console", "warning", stream=io.StringIO())
        app = create_app(load_rules(cfg, env), cfg, env, watch_interval_s=60)
        runner = GatewayRunner(app, access_log=None)
        await runner.setup()
        main = web.TCPSite(runner, "127.0.0.1", 0)
        await main.start()
        await start_admin_site(runner, main, app[ADMIN_LISTEN])
        self.ports = (main._server.sockets[0].getsockname()[1], admin_port)  # type: ignore
        self.runners = [runner, up_runner]

    async def _stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()

    def __enter__(self) -> Threaded:
        self.thread.start()
        assert self.ready.wait(30), "servers did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def ask(self, port: int, method: str, path: str) -> tuple[int, Any, int]:
        """(status, JSON body or None, requests the upstream got meanwhile)."""
        before = self.relayed
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        return resp.status, body, self.relayed - before


@pytest.fixture(scope="module")
def threaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Threaded]:
    with Threaded(tmp_path_factory.mktemp("admin")) as t:
        yield t


def refused_here(status: int, body: Any) -> bool:
    """The split's own 404 (either API shape)."""
    if status != 404 or not isinstance(body, dict):
        return False
    err = body.get("error") or {}
    return err.get("code") == "wrong_listener" or (
        err.get("type") == "not_found_error" and "listen.admin_port" in err.get("message", ""))


segments = st.sampled_from(["admin", "metrics", "healthz", "readyz", "v1", "models", "chat",
                            "completions", "messages", "sessions", "s1", "memory", "console",
                            "%61dmin", "me%74rics", "admin%2Fx", "Admin", "adminx", "",
                            "metrics.txt", "%2e%2e", ".."])
paths = st.lists(segments, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))


@given(path=paths, method=st.sampled_from(["GET", "POST", "DELETE"]))
def test_each_path_has_one_listener(threaded: Threaded, path: str, method: str) -> None:
    """Every path belongs to exactly one of the two listeners: that one answers it (a
    route's answer, a relay, or, on the admin port, "no such route"), the other refuses it
    with its `wrong_listener` 404 (the probes: answered on both; a path refused before
    routing: refused alike on both). Whatever comes in on the admin port never reaches the
    upstream, and whatever the main port answers is relayed."""
    main_port, admin_port = threaded.ports
    main = threaded.ask(main_port, method, path)
    admin = threaded.ask(admin_port, method, path)
    assert admin[2] == 0, f"{method} {path} on the admin port reached the upstream"
    main_refused, admin_refused = refused_here(*main[:2]), refused_here(*admin[:2])
    bad_path = main[0] == admin[0] == 400 and main[1]["error"]["code"] == "invalid_path"
    probe = method == "GET" and path in ("/healthz", "/readyz")
    if probe:
        assert main[0] == admin[0] == 200
    elif not bad_path:
        assert main_refused != admin_refused, (path, main, admin)
        assert main[2] == (0 if main_refused else 1)  # what the main port serves is relayed


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(("listen", "reason"), [
    ({"admin_port": 8080}, "must differ from listen.port (8080)"),
    ({"port": 9000, "admin_port": 9000}, "must differ from listen.port (9000)"),
    ({"admin_port": 0}, "must be between 1 and 65535, got 0"),
    ({"admin_port": 65536}, "must be between 1 and 65535, got 65536"),
    ({"admin_port": "9091"}, "must be an integer or null"),
    ({"admin_port": 9091, "admin_host": 7}, "listen.admin_host"),
])
def test_a_bad_admin_port_is_refused_with_file_line_and_key(
    tmp_path: Path, listen: dict[str, Any], reason: str
) -> None:
    """file:line: listen.admin_port: reason (never taken into effect)."""
    from gateway.errors import RulesError

    cfg = write_config(tmp_path / "gateway.yaml", listen=listen)
    with pytest.raises(RulesError) as refused:
        load_rules(cfg, {})
    assert reason in str(refused.value) and str(refused.value).startswith(f"{cfg}:")
    assert refused.value.line is not None


def test_check_config_refuses_a_bad_admin_port(tmp_path: Path) -> None:
    """The CLI says the same in one line, exits 1, and prints no traceback."""
    from tests.cli.test_cli_and_tokens import memgate

    cfg = write_config(tmp_path / "gateway.yaml", listen={"port": 9000, "admin_port": 9000})
    res = memgate("check-config", str(cfg))
    assert res.returncode == 2  # a config error (README: exit codes)
    assert "Traceback" not in res.stderr
    assert "listen.admin_port: must differ from listen.port (9000)" in res.stderr, res.stderr


def test_serve_refuses_a_port_that_is_the_admin_port(tmp_path: Path) -> None:
    """`serve --port N` with N = listen.admin_port: one line and exit 2, nothing bound."""
    from tests.cli.test_cli_and_tokens import memgate

    port = free_port()
    cfg = write_config(tmp_path / "gateway.yaml", listen={"admin_port": port})
    res = memgate("serve", "--config", str(cfg), "--port", str(port))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert f"--port {port} is listen.admin_port too" in res.stderr


def test_effective_config_keeps_the_admin_listener(tmp_path: Path) -> None:
    """The effective config (what check-config prints) names the admin listener it will
    bind (host defaults to loopback)."""
    from gateway.config.effective import effective_config

    cfg = write_config(tmp_path / "gateway.yaml", listen={"admin_port": 9091})
    effective = effective_config(load_rules(cfg, {}))
    nested = effective.get("listen") or {}  # the effective config as a config file, or flat
    assert nested.get("admin_port", effective.get("listen_admin_port")) == 9091
    assert nested.get("admin_host", effective.get("listen_admin_host")) == "127.0.0.1"
