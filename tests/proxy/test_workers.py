"""`memgate serve --workers N`: N processes on one port, one /metrics, one drain."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import orjson
import pytest
import structlog

from gateway.proxy.workers import (
    MAX_WORKERS,
    Supervisor,
    available_cpus,
    metrics_base,
    parse_workers,
)
from tests.conftest import ROOT, SECRET, Upstream, sample, write_config
from tests.perf.bench_gateway import free_port
from tests.proxy.test_faults import slow_stream_upstream

LISTENING = re.compile(r"^(?:\S+Z )?info listening .* pid=(\d+) worker=(\d+)$", re.M)


async def start_workers(upstream_url: str, tmp_path: Path, config: Path,
                        n: int = 2, env: dict[str, str] | None = None
                        ) -> tuple[Any, int, Path]:
    """`memgate serve --workers n`; (parent process, port, log) once every worker listens."""
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--port", str(port), "--config",
            str(config), "--upstream", upstream_url, "--workers", str(n),
            stdout=out, stderr=out, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    try:
        await wait_log(log, lambda text: len(LISTENING.findall(text)) >= n, proc)
    except BaseException:  # the parent drains and stops its workers: nothing is left behind
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        raise
    return proc, port, log


async def wait_log(log: Path, done: Any, proc: Any, timeout_s: float = 60) -> str:
    """The log's text once `done(text)` holds (the gateway's workers log asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not done(text := log.read_text()):
        if time.monotonic() > deadline or proc.returncode is not None:
            raise AssertionError(text)
        await asyncio.sleep(0.05)
    return text


async def drained(proc: Any) -> int:
    """SIGTERM to the parent: its exit code once every worker drained."""
    proc.send_signal(signal.SIGTERM)
    return int(await asyncio.wait_for(proc.wait(), 30))


async def reap(proc: Any) -> None:
    """A gateway a failed test left running is killed: nothing outlives the test."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def workers_of(text: str) -> dict[str, int]:
    """worker index -> pid of its latest start."""
    return {w: int(pid) for pid, w in LISTENING.findall(text)}


def mem_events(text: str) -> list[dict[str, str]]:
    return [dict(p.partition("=")[::2] for p in ln[6:].split(" "))
            for ln in text.splitlines() if ln.startswith("[mem] ")]


def serving_pid(client_port: int, server_port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the server side of the client's connection (/proc/net/tcp)."""
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    inode = next((cols[9] for ln in Path("/proc/net/tcp").read_text().splitlines()[1:]
                  if (cols := ln.split())[1] == local and cols[2] == remote), None)
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                pass
    return None


async def scrape(port: int, pids: list[int]) -> tuple[int | None, str]:
    """GET /metrics on a new connection: (the worker that answered, the body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    mine = writer.get_extra_info("sockname")[1]
    owner = None
    for _ in range(100):  # accepted within a few ms
        if (owner := serving_pid(mine, port, pids)) is not None:
            break
        await asyncio.sleep(0.01)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    return owner, raw.partition(b"\r\n\r\n")[2].decode()


def total(body: str, name: str, **labels: str) -> float:
    out = 0.0
    for ln in body.splitlines():
        m = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", ln)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            out += float(m.group(2))
    return out


def client(port: int) -> openai.AsyncOpenAI:
    """The OpenAI SDK without keep-alive: each request is a new connection, which the
    kernel may give to any worker."""
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=SECRET, max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx2.Limits(max_keepalive_connections=0)))


@pytest.mark.slow
async def test_workers_share_the_port_the_metrics_and_the_config(upstream: Upstream,
                                                                 tmp_path: Path) -> None:
    """Requests over new connections reach both workers; /metrics from either worker
    counts every request of both; a config change is picked up by each worker; SIGTERM
    exits 0 and removes the metrics directory."""
    cfg = write_config(tmp_path / "gateway.yaml")
    proc, port, log = await start_workers(upstream.url, tmp_path, cfg)
    try:
        pids = list(workers_of(log.read_text()).values())
        sdk = client(port)
        n = 30
        for i in range(n):
            reply = await sdk.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": f"question {i}"}])
            assert reply.choices[0].message.content == "hello from upstream"
        text = await wait_log(log, lambda t: len(mem_events(t)) >= n, proc)
        mems = mem_events(text)
        assert len(mems) == n and {m["worker"] for m in mems} == {"0", "1"}
        assert {m["mode"] for m in mems} == {"shadow"}

        answered: dict[int, float] = {}
        for _ in range(40):  # until both workers answered a scrape with the settled total
            owner, body = await scrape(port, pids)
            assert owner is not None
            answered[owner] = total(body, "memgate_requests_total", status="200")
            assert answered[owner] <= n
            if len(answered) == 2 and set(answered.values()) == {n}:
                break
            await asyncio.sleep(0.05)
        assert answered == {pid: n for pid in pids}

        write_config(cfg, {"enable_eviction": True})
        await wait_log(log, lambda t: len(re.findall(
            r"^(?:\S+Z )?info config_reload result=ok .* worker=\d$", t, re.M)) == 2, proc)
        for i in range(10):
            await sdk.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": f"again {i}"}])
        text = await wait_log(log, lambda t: len(mem_events(t)) >= n + 10, proc)
        assert {m["mode"] for m in mem_events(text)[n:]} == {"on"}
        _, body = await scrape(port, pids)
        assert total(body, "memgate_config_reloads_total", result="ok") == 2
        # the process's own figures, of both workers: CPU and memory summed
        assert total(body, "process_cpu_seconds_total") > 0
        assert total(body, "process_resident_memory_bytes") > 2 * 20e6
        assert re.search(r'^python_info\{.*implementation="CPython".*\} 1\.0$', body, re.M)
        await sdk.close()

        assert await drained(proc) == 0
        assert not list(metrics_base().glob(f"memgate-metrics-{proc.pid}-*"))
        assert SECRET not in log.read_text()
    finally:
        await reap(proc)


@pytest.mark.slow
async def test_a_killed_worker_is_restarted_and_sigterm_drains_every_worker(
        aiohttp_server: Any, tmp_path: Path) -> None:
    """A worker killed with SIGKILL is logged and replaced; then with a stream in flight
    on each worker, SIGTERM to the parent lets every stream finish, every worker writes
    its [mem] lines, and the parent exits 0."""
    up = await slow_stream_upstream(aiohttp_server, n=12, gap_s=0.1)
    cfg = write_config(tmp_path / "gateway.yaml")
    proc, port, log = await start_workers(str(up.make_url("")).rstrip("/"), tmp_path, cfg)
    try:
        os.kill(workers_of(log.read_text())["0"], signal.SIGKILL)
        text = await wait_log(log, lambda t: len(LISTENING.findall(t)) == 3, proc)
        exited = r"^(?:\S+Z )?error worker_exited worker=0 pid=\d+ code=-9 "
        assert re.search(exited, text, re.M), text
        pids = list(workers_of(text).values())

        body = orjson.dumps({**sample("chat_short"), "stream": True})
        sessions: list[aiohttp.ClientSession] = []
        streams: list[tuple[aiohttp.ClientResponse, bytes]] = []
        owners: set[int] = set()
        try:
            while owners != set(pids):  # until each worker has a stream in flight
                assert len(streams) < 24, owners
                s = aiohttp.ClientSession()
                sessions.append(s)
                r = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"Authorization": f"Bearer {SECRET}"})
                first = await r.content.readany()
                assert r.connection is not None and r.connection.transport is not None
                mine = r.connection.transport.get_extra_info("sockname")[1]
                owner = serving_pid(mine, port, pids)
                assert owner is not None
                owners.add(owner)
                streams.append((r, first))
            proc.send_signal(signal.SIGTERM)
            rests = await asyncio.gather(*(r.content.read() for r, _ in streams))
        finally:
            for s in sessions:
                await s.close()
        for (_, first), rest in zip(streams, rests, strict=True):
            assert (first + rest).count(b"data: ") == 12 + 2  # every word, finish, [DONE]
            assert (first + rest).rstrip().endswith(b"data: [DONE]")
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        text = log.read_text()
        assert len(mem_events(text)) == len(streams), text
        for w in ("0", "1"):
            draining = rf"^(?:\S+Z )?info shutting_down drain_s=\S+ worker={w}$"
            assert re.search(draining, text, re.M), text
            stopped = rf"^(?:\S+Z )?info worker_stopped worker={w} pid=\d+ code=0$"
            assert re.search(stopped, text, re.M)
    finally:
        await reap(proc)


@pytest.mark.slow
async def test_a_hung_worker_is_killed_and_restarted(upstream: Upstream,
                                                     tmp_path: Path) -> None:
    """A worker whose event loop stops turning (SIGSTOP here; a stuck loop alike) keeps
    its share of new connections and answers none of them: after MEMGATE_WORKER_HANG_S
    without a heartbeat the parent kills it (logged worker_hung) and starts another;
    then every request is answered again."""
    cfg = write_config(tmp_path / "gateway.yaml")
    proc, port, log = await start_workers(upstream.url, tmp_path, cfg,
                                          env={"MEMGATE_WORKER_HANG_S": "2"})
    try:
        stuck = workers_of(log.read_text())["0"]
        os.kill(stuck, signal.SIGSTOP)
        text = await wait_log(log, lambda t: workers_of(t)["0"] != stuck, proc, 30)
        (hung,) = [ln for ln in text.splitlines() if " worker_hung " in ln]
        assert f"pid={stuck} " in hung and "worker=0" in hung and "action=killed" in hung
        sdk = client(port)
        for i in range(10):  # new connections: the kernel spreads them over both workers
            reply = await asyncio.wait_for(sdk.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": f"q {i}"}]), 10)
            assert reply.choices[0].message.content == "hello from upstream"
        await sdk.close()
        assert await drained(proc) == 0
    finally:
        await reap(proc)


@pytest.mark.slow
async def test_a_draining_or_paused_worker_is_not_taken_for_hung(
        aiohttp_server: Any, tmp_path: Path) -> None:
    """A worker told to stop on its own (SIGTERM to it, not to the parent) drains a
    5 s stream past MEMGATE_WORKER_HANG_S: it beats while it drains, so the stream ends
    whole and nothing is killed. Then the whole group paused past it (docker pause, a
    stopped VM) and resumed: the parent was not running either, no worker is killed."""
    up = await slow_stream_upstream(aiohttp_server, n=20, gap_s=0.25)
    cfg = write_config(tmp_path / "gateway.yaml")
    proc, port, log = await start_workers(str(up.make_url("")).rstrip("/"), tmp_path, cfg,
                                          env={"MEMGATE_WORKER_HANG_S": "2"})
    try:
        pids = list(workers_of(log.read_text()).values())
        body = orjson.dumps({**sample("chat_short"), "stream": True})
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                             headers={"Authorization": f"Bearer {SECRET}"})
            first = await r.content.readany()
            assert r.connection is not None and r.connection.transport is not None
            owner = serving_pid(r.connection.transport.get_extra_info("sockname")[1],
                                port, pids)
            assert owner is not None
            os.kill(owner, signal.SIGTERM)
            whole = first + await r.content.read()
        assert whole.count(b"data: ") == 20 + 2 and whole.rstrip().endswith(b"[DONE]")
        text = await wait_log(log, lambda t: len(LISTENING.findall(t)) == 3, proc)
        assert " worker_hung " not in text
        group = [proc.pid, *workers_of(text).values()]
        for pid in group:
            os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(4)
        for pid in group:
            os.kill(pid, signal.SIGCONT)
        await asyncio.sleep(3)  # past the hang bound once more, everyone running
        assert " worker_hung " not in log.read_text()
        assert len(LISTENING.findall(log.read_text())) == 3
        assert await drained(proc) == 0
    finally:
        await reap(proc)


async def test_a_crash_looping_worker_stops_the_gateway() -> None:
    """Workers that exit right after their start are restarted with a doubling delay;
    the fifth quick failure of one is a crash loop: the supervisor returns 1."""
    crash = [sys.executable, "-c", "raise SystemExit(3)"]
    with structlog.testing.capture_logs() as logs:
        sup = Supervisor(lambda _i: crash, 2, os.environ, structlog.get_logger(),
                         backoff_s=0.01, max_backoff_s=0.04, stable_s=60, max_failures=5)
        assert await asyncio.wait_for(sup.run(), 30) == 1
    loop = [e for e in logs if e["event"] == "workers_crash_loop"]
    assert len(loop) == 1 and loop[0]["failures"] == 5 and loop[0]["code"] == 3
    exited = [e for e in logs if e["event"] == "worker_exited"]
    assert {e["code"] for e in exited} == {3}
    delays = [e["restart_in_s"] for e in exited if e["worker"] == loop[0]["worker"]]
    assert delays == [0.01, 0.02, 0.04, 0.04]


async def test_no_restart_while_the_config_does_not_load() -> None:
    """A worker that dies while the config file is broken is not restarted with it (the
    other keeps serving the last good one); once the file loads, it is."""
    loads = True
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with structlog.testing.capture_logs() as logs:
        sup = Supervisor(lambda _i: sleeper, 2, os.environ, structlog.get_logger(),
                         backoff_s=0.05, can_start=lambda: loads)
        run = asyncio.ensure_future(sup.run())
        while len(sup.procs) < 2:
            await asyncio.sleep(0.01)
        victim = sup.procs[0].pid
        loads = False  # the config file breaks, then a worker dies
        os.kill(victim, signal.SIGKILL)
        while not any(e["event"] == "worker_not_started" for e in logs):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # several retries: still refused, logged once
        assert sup.procs[0].pid == victim
        loads = True
        while sup.procs[0].pid == victim:
            await asyncio.sleep(0.01)
        sup.stop()
        assert await asyncio.wait_for(run, 30) == 0
    assert sum(e["event"] == "worker_not_started" for e in logs) == 1
    assert sum(e["event"] == "worker_started" for e in logs) == 3


@pytest.mark.parametrize(("text", "expected"), [
    ("1", 1), ("2", 2), (" 64 ", 64), ("auto", min(available_cpus(), MAX_WORKERS)),
    ("AUTO", min(available_cpus(), MAX_WORKERS)),
    ("0", None), ("65", None), ("-1", None), ("two", None), ("", None), ("1.5", None),
])
def test_parse_workers(text: str, expected: int | None) -> None:
    """`auto` or 1 to 64 workers; anything else is refused with the value quoted."""
    if expected is None:
        with pytest.raises(ValueError, match="workers must be"):
            parse_workers(text)
    else:
        assert parse_workers(text) == expected


def test_auto_is_the_cpus_this_process_may_use() -> None:
    """`auto` counts the CPUs of this process's affinity mask, never more."""
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))


def test_metrics_dir_is_fresh_and_leftovers_of_dead_gateways_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new private directory each start; one left by a gateway that was killed is
    removed, one of a gateway still running is kept."""
    import subprocess

    from gateway.proxy.workers import metrics_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # $TMPDIR wins over /dev/shm
    monkeypatch.setattr(tempfile, "tempdir", None)  # not cached from before
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f"memgate-metrics-{gone.stdout.strip()}-abc"
    alive = tmp_path / f"memgate-metrics-{os.getppid()}-def"
    for d in (dead, alive):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    fresh = metrics_dir()
    assert fresh.parent == tmp_path and fresh.is_dir() and not list(fresh.iterdir())
    assert (fresh.stat().st_mode & 0o777) == 0o700
    assert not dead.exists() and alive.exists()


@pytest.mark.slow
async def test_workers_see_a_configmap_flip(upstream: Upstream, tmp_path: Path) -> None:
    """A Kubernetes ConfigMap mount: gateway.yaml -> ..data/gateway.yaml, ..data ->
    ..v1. The volume update writes ..v2, flips ..data and deletes ..v1: every worker
    loads the new file (the path is watched as given, never its symlinks resolved)."""
    mount = tmp_path / "mount"
    (mount / "..v1").mkdir(parents=True)
    write_config(mount / "..v1" / "gateway.yaml")
    (mount / "..data").symlink_to("..v1")
    (mount / "gateway.yaml").symlink_to("..data/gateway.yaml")
    proc, port, log = await start_workers(upstream.url, tmp_path, mount / "gateway.yaml")
    try:
        (mount / "..v2").mkdir()
        write_config(mount / "..v2" / "gateway.yaml", {"enable_eviction": True})
        (mount / "..data_tmp").symlink_to("..v2")
        (mount / "..data_tmp").rename(mount / "..data")  # atomic, as the kubelet does
        shutil.rmtree(mount / "..v1")
        await wait_log(log, lambda t: len(re.findall(
            r"^(?:\S+Z )?info config_reload result=ok .* worker=\d$", t, re.M)) == 2, proc)
        assert await drained(proc) == 0
    finally:
        await reap(proc)
