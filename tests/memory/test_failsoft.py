"""Backends that fail soft: a Redis that refuses or hangs, a SQLite store that cannot be
opened or written, a PostgreSQL on the wrong port. Every chat request still gets the
upstream's answer and its [mem] line; the failure is counted, logged once per interval
and shown by /readyz."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.memory.backends import Backend, BackendDown
from tests.conftest import CHAT_REPLY, ROOT, SECRET, Gateway, GatewayFactory, Upstream, write_config
from tests.perf.bench_gateway import free_port

REDIS_PORTS = range(6391, 6396)  # this suite's own redis-servers; never the machine's 6379
AUTH = {"Authorization": f"Bearer {SECRET}"}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A redis-server of our own on a free port of 6391-6395, stopped by its PID (resumed
    first if a test left it SIGSTOPped)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = next((p for p in REDIS_PORTS if _port_free(p)), None)
    if port is None:
        pytest.skip("ports 6391-6395 are all taken")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--daemonize", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while _port_free(port):
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield proc, port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def long_history(turns: int, tag: str = "") -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"{tag} question {t}: " + "budget details " * 40},
                 {"role": "assistant", "content": f"answer {t}: " + "numbers and totals " * 40}]
    msgs.append({"role": "user", "content": f"{tag} what was the budget again?"})
    return msgs


EVICT = {"enable_eviction": True,
         "budget": {"max_tokens": 1200, "max_chars": None, "max_messages": None,
                    "max_turns": None},
         "eviction": {"recall_share": 0}}  # dropped turns stay dropped: they are archived


async def chat(s: aiohttp.ClientSession, gw: Gateway, messages: list[dict[str, Any]],
               session: str = "s-1") -> tuple[int, dict[str, Any], float]:
    """One chat request on the session `s` (keep-alive): status, body, seconds."""
    t0 = time.perf_counter()
    async with s.post(f"{gw.url}/v1/chat/completions",
                      data=orjson.dumps({"model": "gpt-4o-mini", "messages": messages}),
                      headers={**AUTH, "X-Session-Id": session}) as r:
        body = await r.json(content_type=None)
        return r.status, body, time.perf_counter() - t0


async def metric(gw: Gateway, name: str) -> dict[str, float]:
    """Samples of one metric family from /metrics: label text -> value."""
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    out = {}
    for ln in text.splitlines():
        if ln.startswith(name) and not ln.startswith("#"):
            key, _, value = ln.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


async def readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/readyz") as r:
        return r.status, await r.json()


def log_count(gw: Gateway, event: str) -> int:
    return sum(1 for ln in gw.log.getvalue().splitlines() if f" {event} " in ln)


def logged_once_per_op(text: str) -> dict[str, int]:
    """backend_error lines by "backend op", each asserted to be logged once."""
    seen: dict[str, int] = {}
    for ln in text.splitlines():
        if " backend_error " in ln:
            kv = dict(p.split("=", 1) for p in ln.split() if "=" in p)
            key = f"{kv['backend']} {kv['op']}"
            seen[key] = seen.get(key, 0) + 1
    assert seen and all(n == 1 for n in seen.values()), seen
    return seen


# --------------------------------------------------------------------------- Redis


@pytest.fixture
async def redis_gateway(gateway: GatewayFactory) -> AsyncIterator[Any]:
    """(start(port), proc, port): a gateway with Redis session state on our redis-server."""
    with redis_server() as (proc, port):

        async def start(memory: dict[str, Any] = EVICT, **state: Any) -> Gateway:
            return await gateway(memory=memory,
                                 env={"MEMGATE_REDIS_URL": f"redis://127.0.0.1:{port}/0",
                                      "MEMGATE_ADMIN_TOKEN": "adm"},
                                 state={"backend": "redis", "key_prefix": "memgate-failsoft",
                                        **state})

        yield start, proc, port


async def test_refused_redis_keeps_the_mem_line_and_says_so(redis_gateway: Any,
                                                            upstream: Upstream) -> None:
    """Redis refusing connections: every request gets the upstream's answer and its [mem]
    line (cut=unknown, state=unavailable), the failure is counted per operation, logged
    once for the lot, the breaker skips Redis, and /readyz stays 200 but says degraded."""
    start, proc, _ = redis_gateway
    proc.kill()
    proc.wait(10)
    gw = await start()
    async with aiohttp.ClientSession() as s:
        for i in range(8):
            status, body, _ = await chat(s, gw, long_history(6), session=f"s-{i % 2}")
            assert status == 200 and body == CHAT_REPLY
    events = await gw.wait_mem(8, timeout_s=5)
    assert len(events) == 8
    assert all(e["status"] == "200" and e["state"] == "unavailable" and e["cut"] == "unknown"
               and "prefix_tokens" not in e for e in events)
    assert "mem_log_failed" not in gw.log.getvalue()
    errors = await metric(gw, "memgate_backend_errors_total")
    assert sum(v for k, v in errors.items() if 'backend="redis"' in k) >= 1
    skipped = await metric(gw, "memgate_backend_skipped_total")
    assert sum(v for k, v in skipped.items() if 'backend="redis"' in k) >= 1  # breaker open
    assert log_count(gw, "backend_error") == 1
    assert len(upstream.received) == 8
    requests = await metric(gw, "memgate_requests_total")
    assert sum(requests.values()) == 8  # the metrics are observed too
    async with aiohttp.ClientSession() as s, s.get(
            f"{gw.url}/admin/sessions/s-0/memory", headers={"X-Memgate-Admin-Token": "adm"}) as r:
        assert r.status == 503 and (await r.json())["error"]["code"] == "backend_unavailable"
    code, ready = await readyz(gw)
    assert code == 200 and ready["status"] == "degraded"
    assert ready["backends"]["state"]["backend"] == "redis"
    assert ready["backends"]["state"]["status"] == "down"
    assert "ConnectionError" in ready["backends"]["state"]["last_error"]


SHADOW = {"enable_eviction": False, "shadow": True}


@pytest.mark.slow
@pytest.mark.parametrize("memory", [EVICT, SHADOW], ids=["evict", "shadow"])
async def test_hung_redis_costs_no_time_per_request(redis_gateway: Any,
                                                    memory: dict[str, Any]) -> None:
    """A Redis that accepts and never answers (SIGSTOP): requests on one keep-alive
    connection answer at once, each [mem] line is written within the read timeout
    (fields Redis keeps marked missing), and after SIGCONT the fields come back once the
    breaker lets Redis be tried again. In shadow mode the body is forwarded before it is
    measured: that path does not wait on Redis either."""
    start, proc, _ = redis_gateway
    gw = await start(memory, connect_timeout_s=0.25, read_timeout_s=0.5, retry_after_s=1)
    on = memory is EVICT
    msgs = long_history(6)
    async with aiohttp.ClientSession() as s:
        status, _, _ = await chat(s, gw, msgs)
        assert status == 200
        first = (await gw.wait_mem(1))[0]
        assert "state" not in first and (first["cut"] in ("moved", "kept") if on else True)
        os.kill(proc.pid, signal.SIGSTOP)
        took = []
        for i in range(6):
            status, body, dt = await chat(s, gw, msgs)
            assert status == 200 and body == CHAT_REPLY
            took.append(dt)
            events = await gw.wait_mem(2 + i, timeout_s=1.5)  # within the timeouts
            assert events[-1]["state"] == "unavailable" and events[-1]["status"] == "200"
            assert events[-1].get("cut") == ("unknown" if on else None)
        assert max(took) < 0.3, took  # the client never waits for Redis
        os.kill(proc.pid, signal.SIGCONT)
        await asyncio.sleep(1.2)  # retry_after_s: the breaker lets one request try again
        for _ in range(2):
            await chat(s, gw, msgs)
        events = await gw.wait_mem(9, timeout_s=3)
    assert "state" not in events[-1]
    assert events[-1].get("cut") in (("moved", "kept") if on else (None,))
    code, ready = await readyz(gw)
    assert code == 200 and ready["backends"]["state"]["status"] == "ok"
    assert ready["status"] == "ready"


# --------------------------------------------------------------------------- memory store


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """A read-only directory that holds even for root (tests run as root, so chmod does
    not): the ext4 immutable attribute. Skipped where chattr is refused."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i refused here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


async def store_gateway(gateway: GatewayFactory, store: dict[str, Any],
                        env: dict[str, str] | None = None) -> Gateway:
    gw = await gateway(memory=EVICT, env=env,
                       store={"archive": "evicted", "recall": {"enabled": True, "top_k": 2},
                              **store})
    # so a test sees the store come back
    gw.state.store_health.retry_after_s = gw.state.archive_health.retry_after_s = 0.5
    return gw


async def assert_forwarded_without_recall(gw: Gateway, upstream: Upstream, n: int,
                                          max_s: float) -> list[dict[str, str]]:
    """n chat requests: each answered by the upstream within max_s, each forwarded
    evicted, each [mem] line marks the recall failed; (the [mem] events)."""
    sent = long_history(6, tag="KESTREL")
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            status, body, dt = await chat(s, gw, sent, session=f"s-{i}")
            assert status == 200 and body == CHAT_REPLY, body
            assert dt < max_s, dt
    assert len(upstream.received) == n
    assert all(len(orjson.loads(r["raw"])["messages"]) < len(sent) for r in upstream.received)
    events = await gw.wait_mem(n)
    assert all(e["status"] == "200" and e["recall"] == "failed" and int(e["dropped"]) > 0
               for e in events)
    return events


async def test_read_only_sqlite_directory_degrades_recall_only(
        gateway: GatewayFactory, upstream: Upstream, tmp_path: Path) -> None:
    """SQLite in a directory nothing may write to: chat requests are forwarded (evicted,
    recalling only the turns they drop), [mem] says recall=failed, the failure is counted
    and logged once; when the directory is writable again recall and archive resume."""
    ro = tmp_path / "ro"
    ro.mkdir()
    gw = await store_gateway(gateway, {"path": str(ro / "memgate.db")})
    with immutable(ro):
        await assert_forwarded_without_recall(gw, upstream, 6, max_s=1.0)
    errors = await metric(gw, "memgate_backend_errors_total")
    assert errors.get('{backend="store",op="open"}', 0) >= 1
    assert "store open" in logged_once_per_op(gw.log.getvalue())
    code, ready = await readyz(gw)
    assert code == 200 and ready["status"] == "degraded"
    assert "OperationalError" in ready["backends"]["store"]["last_error"]
    await asyncio.sleep(0.6)  # retry_after_s
    async with aiohttp.ClientSession() as s:
        status, _, _ = await chat(s, gw, long_history(6, tag="KESTREL"), session="s-back")
    ev = (await gw.wait_mem(7))[-1]
    assert status == 200 and "recall" not in ev and int(ev["archived"]) > 0
    await gw.state.memory.queue.join()
    assert gw.state.memory.written > 0
    assert (await readyz(gw))[1]["backends"]["store"]["status"] == "ok"


async def test_locked_sqlite_costs_a_request_at_most_the_recall_bound(
        gateway: GatewayFactory, upstream: Upstream, tmp_path: Path) -> None:
    """A SQLite file another process holds an exclusive lock on (SQLite itself waits 5 s
    for it): the first request waits at most the recall bound, the next ones not at all
    while the breaker is open; all are answered and say recall=failed."""
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        gw = await store_gateway(gateway, {"path": str(path)})
        gw.state.store_health.retry_after_s = 30  # no probe during this test
        t0 = time.perf_counter()
        await assert_forwarded_without_recall(gw, upstream, 4, max_s=1.0)
        assert time.perf_counter() - t0 < 1.5  # 0.5 s once, not 5 s per request
        errors = await metric(gw, "memgate_backend_errors_total")
        assert errors.get('{backend="store",op="open"}', 0) == 1
        assert (await metric(gw, "memgate_backend_skipped_total"))['{backend="store"}'] >= 3
    finally:
        holder.close()


async def test_postgres_on_a_wrong_port_degrades_recall_only(
        gateway: GatewayFactory, upstream: Upstream) -> None:
    """PostgreSQL nobody listens for: forwarded, recall=failed, counted, logged once."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    gw = await store_gateway(gateway, {"backend": "postgres"},
                             env={"MEMGATE_STORE_DSN": f"postgresql://postgres@127.0.0.1:{port}/test"})
    gw.state.store_health.retry_after_s = 0  # tried again on every request: still one line
    await assert_forwarded_without_recall(gw, upstream, 6, max_s=1.0)
    errors = await metric(gw, "memgate_backend_errors_total")
    assert errors['{backend="store",op="open"}'] == 6
    assert logged_once_per_op(gw.log.getvalue()) == {"store open": 1, "archive open": 1}


# --------------------------------------------------------------------------- the breaker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeLog:
    """Records each logged event with the (fake) time it was logged."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.lines: list[dict[str, Any]] = []

    def error(self, event: str, **kw: Any) -> None:
        self.lines.append({"event": event, "at": self.clock.now, **kw})


async def test_breaker_skips_a_failed_backend_then_lets_one_call_probe() -> None:
    """After a failure the backend is not called for retry_after_s; then one call probes
    while concurrent ones still skip; its success closes the breaker."""
    clock = Clock()
    log = FakeLog(clock)
    b = Backend("redis", lambda: log, retry_after_s=5, clock=clock)
    calls = 0

    async def refuse() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("refused")

    with pytest.raises(BackendDown):
        await b.call("get_record", refuse)
    with pytest.raises(BackendDown):
        await b.call("get_record", refuse)
    assert calls == 1 and b.skipped == 1 and not b.up
    clock.now += 5
    release = asyncio.Event()

    async def answer() -> str:
        nonlocal calls
        calls += 1
        await release.wait()
        return "ok"

    probe = asyncio.ensure_future(b.call("get_record", answer))
    await asyncio.sleep(0)
    with pytest.raises(BackendDown):  # the probe is still out
        await b.call("get_record", answer)
    release.set()
    assert await probe == "ok" and calls == 2 and b.up
    assert await b.call("get_record", answer) == "ok"
    assert b.errors == {"get_record": 1} and len(log.lines) == 1


async def test_breaker_bounds_a_hung_call_by_its_timeout() -> None:
    """A call that never answers fails after timeout_s (TimeoutError, counted)."""
    b = Backend("store", lambda: FakeLog(), retry_after_s=1)
    t0 = time.perf_counter()
    with pytest.raises(BackendDown):
        await b.call("search", asyncio.Event().wait, timeout_s=0.05)
    assert time.perf_counter() - t0 < 0.5
    assert b.errors == {"search": 1} and b.last_error == "TimeoutError: timed out"


@settings(max_examples=60)
@given(st.lists(st.tuples(st.floats(0, 40), st.sampled_from(["get_record", "put_record"]),
                          st.booleans()), max_size=60))
def test_failures_are_logged_once_per_interval_and_none_is_lost(
        events: list[tuple[float, str, bool]]) -> None:
    """For any run of failures and successes: per operation, logged lines are at least
    log_every_s apart, and logged lines plus their `suppressed` counts plus the failures
    not logged yet add up to every failure."""
    clock = Clock()
    log = FakeLog(clock)
    b = Backend("redis", lambda: log, retry_after_s=0, log_every_s=60, clock=clock)

    async def run() -> None:
        for dt, op, ok in events:
            clock.now += dt

            async def outcome(ok: bool = ok) -> None:
                if not ok:
                    raise TimeoutError

            with contextlib.suppress(BackendDown):
                await b.call(op, outcome)

    asyncio.run(run())
    for op, n in b.errors.items():
        lines = [ln for ln in log.lines if ln["op"] == op]
        assert all(b2["at"] - a["at"] >= 60 for a, b2 in itertools.pairwise(lines))
        pending = b._logged[op][1]
        assert sum(1 + ln["suppressed"] for ln in lines) + pending == n
    assert sum(b.errors.values()) == sum(1 for *_, ok in events if not ok)


async def test_readyz_reports_backends_and_the_last_reload(gateway: GatewayFactory) -> None:
    """/readyz: each backend's state and the last reload's time, result and reason; a
    refused config leaves the gateway serving (200, degraded) until a good one loads."""
    gw = await gateway()
    code, ready = await readyz(gw)
    assert code == 200 and ready["status"] == "ready" and "reload" not in ready
    assert ready["backends"]["state"] == {"backend": "memory", "status": "ok"}
    assert ready["backends"]["store"]["status"] == "ok"
    assert ready["backends"]["store"]["opened"] is False
    good = gw.config.read_text()
    gw.config.write_text(good.replace("max_tokens: 6000", "max_tokens: -3"))
    deadline = time.monotonic() + 5
    while (ready := (await readyz(gw))[1]).get("reload", {}).get("result") != "failed":
        assert time.monotonic() < deadline, ready
        await asyncio.sleep(0.05)
    assert ready["status"] == "degraded" and "max_tokens" in ready["reload"]["error"]
    gw.config.write_text(good.replace("max_tokens: 6000", "max_tokens: 5000"))
    while (ready := (await readyz(gw))[1])["reload"]["result"] != "ok":
        assert time.monotonic() < deadline + 5, ready
        await asyncio.sleep(0.05)
    assert ready["status"] == "ready" and "error" not in ready["reload"]


@pytest.mark.slow
async def test_full_disk_loses_archive_writes_not_requests(upstream: Upstream,
                                                           tmp_path: Path) -> None:
    """SQLite on a 256 KiB tmpfs (`memgate serve` in its own mount namespace, so nothing
    is mounted on the machine): once the disk is full the archive writes fail with
    SQLITE_FULL; every chat request is still answered and recalls (reads still work),
    the failures are counted and logged once."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = write_config(tmp_path / "gateway.yaml", EVICT,
                       store={"path": str(disk / "memgate.db"), "archive": "evicted",
                              "recall": {"enabled": True, "top_k": 2}})
    port = free_port()
    log = tmp_path / "serve.log"
    script = 'mount -t tmpfs -o size=256k memgate-full "$0" && exec "$@"'
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(disk),
            sys.executable, "-m", "gateway", "serve", "--port", str(port), "--config", str(cfg),
            "--upstream", upstream.url, stdout=out, stderr=out, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                if proc.returncode is not None or time.monotonic() > deadline:
                    pytest.skip(f"no tmpfs in a mount namespace here: {log.read_text()[-300:]}")
                await asyncio.sleep(0.1)
        failed = 0.0
        async with aiohttp.ClientSession() as s:
            for i in range(60):
                async with s.post(f"{url}/v1/chat/completions", headers={
                        **AUTH, "X-Session-Id": f"s-{i}"}, data=orjson.dumps(
                            {"model": "gpt-4o-mini", "messages": long_history(6, f"T{i}")})) as r:
                    assert r.status == 200 and await r.json() == CHAT_REPLY
                async with s.get(f"{url}/metrics") as r:
                    text = await r.text()
                failed = sum(float(ln.rpartition(" ")[2]) for ln in text.splitlines()
                             if ln.startswith('memgate_backend_errors_total{backend="archive"'))
                if failed and i >= 20:
                    break
        assert failed >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    text = log.read_text()
    assert proc.returncode == 0, text[-2000:]
    assert logged_once_per_op(text) == {"archive write": 1}, text[-2000:]
    assert "database or disk is full" in text
    mem = [ln for ln in text.splitlines() if ln.startswith("[mem] ")]
    assert len(mem) == i + 1
    assert not any("recall=failed" in ln for ln in mem)  # a full disk still reads
    assert "Traceback" not in text
