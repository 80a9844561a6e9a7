"""Faults under real sockets: SIGTERM drains in-flight streams, a slow client gets
bounded buffering, a client that leaves leaks nothing, oversized headers and
chunked bodies are refused, and secrets reach no sink."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import ROOT, SECRET, GatewayFactory, Upstream, sample, sse_chunks
from tests.perf.bench_gateway import free_port


async def slow_stream_upstream(aiohttp_server: Any, n: int, gap_s: float) -> Any:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in sse_chunks([f"w{i} " for i in range(n)]):
            await resp.write(chunk)
            await asyncio.sleep(gap_s)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return await aiohttp_server(app)


async def start_serve(upstream_url: str, tmp_path: Path, *extra: str) -> tuple[Any, int, Path]:
    """`memgate serve` as its own process; (process, port, log file) once it listens."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--port", str(port),
            "--config", str(ROOT / "rules" / "gateway.yaml"), "--upstream", upstream_url,
            *extra, stdout=out, stderr=out, cwd=tmp_path,
            # this checkout's gateway, not the one the venv was installed from
            env={**os.environ, "MEMGATE_ENABLE_EVICTION": "1", "PYTHONPATH": str(ROOT)},
        )
    deadline = time.monotonic() + 20
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc, port, log
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(log.read_text()) from None
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_sigterm_drains_in_flight_stream(aiohttp_server: Any, tmp_path: Path) -> None:
    """`memgate serve` on SIGTERM stops accepting, finishes the stream in flight (every
    chunk and the end of the stream), writes its [mem] line and exits 0."""
    up = await slow_stream_upstream(aiohttp_server, n=12, gap_s=0.1)
    proc, port, log = await start_serve(str(up.make_url("")).rstrip("/"), tmp_path)
    try:
        body = orjson.dumps({**sample("chat_short"), "stream": True})
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                headers={"Content-Type": "application/json"}) as r:
            first = await r.content.readany()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = False
            try:  # no new connections once draining
                async with aiohttp.ClientSession() as s2, s2.get(
                        f"http://127.0.0.1:{port}/healthz",
                        timeout=aiohttp.ClientTimeout(total=2)) as r2:
                    await r2.read()
            except (TimeoutError, aiohttp.ClientError):
                refused = True
            rest = await r.content.read()
        stream = first + rest
        assert refused
        assert stream.count(b"data: ") == 12 + 2  # every word, the finish chunk, [DONE]
        assert stream.rstrip().endswith(b"data: [DONE]")
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        text = log.read_text()
        mem = [ln for ln in text.splitlines() if ln.startswith("[mem] ")]
        assert len(mem) == 1 and "status=200" in mem[0] and "stream=" not in mem[0], text
        assert "shutting_down" in text
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_sigterm_drain_has_a_deadline(aiohttp_server: Any, tmp_path: Path) -> None:
    """A stream longer than --drain-s is cut at the deadline: the process exits 0 in
    time and the [mem] line says the stream did not complete."""
    up = await slow_stream_upstream(aiohttp_server, n=200, gap_s=0.05)  # 10 s
    proc, port, log = await start_serve(str(up.make_url("")).rstrip("/"), tmp_path,
                                        "--drain-s", "1")
    try:
        body = orjson.dumps({**sample("chat_short"), "stream": True})
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                headers={"Content-Type": "application/json"}) as r:
            await r.content.readany()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                got = await r.content.read()
            except aiohttp.ClientPayloadError:
                got = b""
            assert b"[DONE]" not in got
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert time.monotonic() - t0 < 5
        mem = [ln for ln in log.read_text().splitlines() if ln.startswith("[mem] ")]
        assert len(mem) == 1 and "stream=" in mem[0], log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_slow_client_gets_bounded_buffering(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """A client that stops reading a fast stream holds the upstream back (backpressure):
    the gateway buffers a bounded amount, not the stream; then everything arrives."""
    total, size = 256 << 20, 256 << 10
    sent = [0]

    async def flood(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = b"data: " + b"x" * (size - 8) + b"\n\n"
        while sent[0] < total:
            await resp.write(chunk)
            sent[0] += len(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", flood)
    up = await aiohttp_server(app)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    body = orjson.dumps({**sample("chat_short"), "stream": True})
    async with aiohttp.ClientSession() as s, s.post(
            f"{gw.url}/v1/chat/completions", data=body,
            headers={"Content-Type": "application/json"}) as r:
        got = len(await r.content.readany())
        await asyncio.sleep(1.0)  # the client reads nothing
        stalled_at = sent[0]
        await asyncio.sleep(0.5)
        assert sent[0] == stalled_at  # the upstream is held back, not drained into memory
        assert stalled_at < 64 << 20, stalled_at  # socket buffers + a few chunks, of 256 MiB
        while chunk := await r.content.readany():
            got += len(chunk)
    assert got == total == sent[0]
    assert (await gw.wait_mem(1))[-1]["status"] == "200"


async def test_client_gone_leaks_no_task_or_connection(
    gateway: GatewayFactory, aiohttp_server: Any
) -> None:
    """Clients that leave mid-stream: the upstream request is cancelled, accounting ends,
    no task is left behind and no upstream connection stays open."""
    up = await slow_stream_upstream(aiohttp_server, n=1000, gap_s=0.01)
    gw = await gateway(upstream_url=str(up.make_url("")).rstrip("/"))
    await asyncio.sleep(0)
    baseline = len(asyncio.all_tasks())
    body = orjson.dumps({**sample("chat_short"), "stream": True})
    for _ in range(5):
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{gw.url}/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
            await r.content.readany()
            r.close()
    events = await gw.wait_mem(5)
    assert [e["stream"] for e in events] == ["client_gone"] * 5
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and (
            len(asyncio.all_tasks()) > baseline or gw.state.background
            or len(up.handler.connections)):  # the upstream server's open connections
        await asyncio.sleep(0.05)
    assert not gw.state.background
    assert len(asyncio.all_tasks()) <= baseline
    assert len(up.handler.connections) == 0  # upstream connections closed, not parked


async def test_oversized_headers_and_chunked_bodies_refused(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """A 64 KiB header is refused before any handler; a chunked body over
    limits.max_body_bytes is refused on chat and passthrough routes (413, the client's
    error format) and nothing reaches the upstream; the gateway keeps serving."""
    gw = await gateway(limits={"max_body_bytes": 4096})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/v1/models", headers={"X-Big": "a" * 65536}) as r:
            assert 400 <= r.status < 500
        for path in ("/v1/chat/completions", "/v1/echo", "/v1/messages"):

            async def chunks() -> Any:
                for _ in range(10):
                    yield b"x" * 1024

            async with s.post(gw.url + path, data=chunks(),
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413, (path, r.status)
                err = orjson.loads(await r.read())
                assert "limits.max_body_bytes" in (
                    err["error"]["message"] if "error" in err else "")
                if path == "/v1/messages":
                    assert err["type"] == "error"
        assert upstream.received == []
        async with s.get(f"{gw.url}/v1/models") as r:
            assert r.status == 200
        # a passthrough body with a Content-Length within the limit is streamed through
        big = b"\x00upload" * 512
        async with s.post(f"{gw.url}/v1/echo", data=big) as r:
            assert r.status == 201 and await r.read() == big


async def test_secrets_reach_no_sink(
    gateway: GatewayFactory, upstream: Upstream, tmp_path: Path
) -> None:
    """API keys, bearer tokens and cookies appear in no log line, capture file, metric,
    error body, memory record or admin view — on success, upstream error, refusal."""
    cap = tmp_path / "cap"
    gw = await gateway(
        # a refusal of bad metadata is one of the error bodies checked
        memory={"enable_eviction": True, "markers": {"on_bad_metadata": "reject"}},
        level="debug",
        logging={"level": "debug"},
        capture={"enabled": True, "dir": str(cap), "sample_rate": 1.0},
        store={"archive": "all", "path": str(tmp_path / "mem.db")},
        env={"MEMGATE_ADMIN_TOKEN": "admin-" + SECRET},
        limits={"max_body_bytes": 262144},
    )
    secrets = [SECRET, "cookie-" + SECRET, "xkey-" + SECRET, "body-" + SECRET]
    hdrs = {"Authorization": f"Bearer {SECRET}", "x-api-key": "xkey-" + SECRET,
            "Cookie": f"session=cookie-{SECRET}", "Content-Type": "application/json",
            "X-Session-Id": "sec"}
    bodies, statuses = [], []
    async with aiohttp.ClientSession() as s:
        for path, body in (
            ("/v1/chat/completions", orjson.dumps(sample("chat_long_tools"))),
            # a credential in the body (LiteLLM-style clients): relayed, never captured
            ("/v1/chat/completions", orjson.dumps({**sample("chat_short"),
                                                   "api_key": "body-" + SECRET})),
            ("/v1/messages", orjson.dumps(sample("anthropic_long_tools"))),
            ("/status/429/v1/chat/completions", orjson.dumps(sample("chat_short"))),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x", '
                                     b'"memgate": {"score": 7}}]}'),
            ("/v1/chat/completions", b"x" * 300_000),
        ):
            async with s.post(gw.url + path, data=body, headers=hdrs) as r:
                bodies.append(await r.read())
                statuses.append(r.status)
        await gw.wait_mem(5)
        async with s.get(f"{gw.url}/metrics") as r:
            bodies.append(await r.read())
            statuses.append(r.status)
        async with s.get(f"{gw.url}/admin/sessions/sec/memory",
                         headers={"X-Memgate-Admin-Token": "admin-" + SECRET}) as r:
            bodies.append(await r.read())
            statuses.append(r.status)
        await asyncio.wait_for(gw.state.memory.queue.join(), 10)  # archived turns written
        query = {"query": "orders", "filter": {"session_id": "sec"}}
        async with s.post(f"{gw.url}/v1/memories/search", headers=hdrs,
                          data=orjson.dumps(query)) as r:
            bodies.append(await r.read())
            statuses.append(r.status)
    # (the admin view answers 404 when nothing was carried for the session)
    assert statuses[:7] + statuses[8:] == [200, 200, 200, 429, 400, 413, 200, 200], statuses
    assert statuses[7] in (200, 404)
    assert orjson.loads(bodies[-1])["results"], bodies[-1][:300]  # the archive answers
    await gw.state.capture.drain()
    sinks = {"log": gw.log.getvalue().encode(), "responses": b"\n".join(bodies)}
    for f in sorted(cap.rglob("*")) if cap.exists() else []:
        if f.is_file():
            sinks[f"capture:{f.name}"] = f.read_bytes()
    for f in sorted(tmp_path.glob("mem.db*")):
        sinks[f"store:{f.name}"] = f.read_bytes()
    assert any(k.startswith("capture:") for k in sinks), "capture wrote nothing"
    assert "store:mem.db" in sinks, "nothing archived"
    assert sinks["log"].count(b"[mem]") >= 5
    assert any(b"[redacted]" in v for k, v in sinks.items() if k.startswith("capture:"))
    for name, data in sinks.items():
        for secret in secrets:
            assert secret.encode() not in data, f"{secret!r} leaked into {name}"


async def test_config_that_vanishes_or_turns_unreadable_keeps_last_good(
    gateway: GatewayFactory, upstream: Upstream
) -> None:
    """The config file deleted, then replaced by something unreadable (a directory),
    mid-run: each reload is refused and logged, the last good config keeps serving;
    a good file again is picked up."""
    gw = await gateway(memory={"enable_eviction": True})
    good = gw.state.rules
    text = gw.config.read_text()
    body = orjson.dumps(sample("chat_long_tools"))

    async def refused(n: int) -> None:
        deadline = time.monotonic() + 3.0
        while gw.log.getvalue().count("config_reload result=failed") < n:
            assert time.monotonic() < deadline, gw.log.getvalue()
            await asyncio.sleep(0.05)
        assert gw.state.rules is good
        async with aiohttp.ClientSession() as s, s.post(
                f"{gw.url}/v1/chat/completions", data=body,
                headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
        assert gw.mem_events()[-1]["mode"] == "on"
        assert int(gw.mem_events()[-1]["dropped"]) > 0

    gw.config.unlink()
    await refused(1)
    gw.config.mkdir()
    await refused(2)
    gw.config.rmdir()
    gw.config.write_text(text.replace("enable_eviction: true", "enable_eviction: false"))
    deadline = time.monotonic() + 3.0
    while gw.state.rules.memory.mode == "on":
        assert time.monotonic() < deadline, gw.log.getvalue()
        await asyncio.sleep(0.05)
    assert gw.state.rules.memory.mode == "shadow"
