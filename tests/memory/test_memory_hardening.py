"""The memory API under hostile input and broken stores, through real HTTP: bodies bounded
by limits.max_body_bytes, a failing store answered 503 with its cause, calendar-edge
timestamps, deep nesting, NUL and huge queries refused or bounded -- never a bare 500."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.measure.terms import MAX_QUERY_TERMS
from gateway.memory.store.model import KINDS
from gateway.memory.store.sqlite import SqliteStore
from tests.conftest import PG_DSN, ROOT, GatewayFactory, pg_schema
from tests.memory.test_memory_api import (
    AUTH,
    BACKENDS,
    SEED_WRITE,
    call,
    conversation,
    memory_gateway,
)
from tests.perf.bench_gateway import free_port


def assert_shaped(status: int, body: Any, want: int, code: str | None = None) -> str:
    """An error in the API's (OpenAI) error shape; its message."""
    assert status == want, body
    err = body["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["type"] == "gateway_error"
    if code is not None:
        assert err["code"] == code, err
    return str(err["message"])


async def test_body_over_max_body_bytes_is_413_and_not_read_whole(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A write or search body over limits.max_body_bytes is a 413 in the API's shape, with a
    Content-Length or chunked; one under the limit is served."""
    gw = await gateway(store={"path": str(tmp_path / "m.db")}, limits={"max_body_bytes": 65536})
    base = f"{gw.url}/v1/memories"
    big = orjson.dumps({**SEED_WRITE, "text": "预算 " * 400_000})  # ~2.8 MB

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 16384):
            yield big[i:i + 16384]

    async with aiohttp.ClientSession() as s:
        for url in (base, f"{base}/search"):
            for data in (io.BytesIO(big), chunked()):
                async with s.post(url, data=data, headers=AUTH) as r:
                    msg = assert_shaped(r.status, await r.json(), 413, "payload_too_large")
                    assert "65536" in msg and "limits.max_body_bytes" in msg
    assert (await call("POST", base, {**SEED_WRITE, "text": "预算 " * 1000}, AUTH))[0] == 201


async def test_unreachable_sqlite_store_is_503_with_the_cause(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """A store path the gateway cannot create (its parent is a file) answers every memory
    route with a shaped 503 that names the cause; the chat route is untouched."""
    (tmp_path / "not-a-dir").write_text("x")
    gw = await gateway(store={"path": str(tmp_path / "not-a-dir" / "m.db")})
    base = f"{gw.url}/v1/memories"
    for method, url, body in (("POST", base, SEED_WRITE),
                              ("POST", f"{base}/search", {"filter": {"session_id": "s"}}),
                              ("GET", f"{base}/x", None), ("DELETE", f"{base}/x", None)):
        status, err = await call(method, url, body, AUTH)
        msg = assert_shaped(status, err, 503, "store_unavailable")
        assert "not-a-dir" in msg, msg


async def start_serve_as(uid: int | None, config: Path, cwd: Path) -> tuple[Any, int]:
    """`memgate serve` as its own process (as user and group `uid`, through setpriv)."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--config", str(config)]
    if uid is not None:
        cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=cwd, env=env,
                                                stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.returncode is not None:
                if proc.returncode is None:
                    proc.kill()
                raise AssertionError((await proc.communicate())[1].decode()) from None
            await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_read_only_sqlite_directory_is_503(tmp_path: Path) -> None:
    """A SQLite store in a read-only directory (root ignores modes: the server then runs as
    nobody) answers writes with a shaped 503 naming the cause, not a text/plain 500."""
    work = Path(tempfile.mkdtemp(prefix="memgate-ro-"))
    try:
        seeded = SqliteStore(str(work / "store" / "m.db"))
        await seeded.open()
        await seeded.close()
        cfg = work / "g.yaml"
        cfg.write_text(f"store:\n  path: {work / 'store' / 'm.db'}\n")
        for p in (work / "store", *(work / "store").iterdir()):
            p.chmod(0o555 if p.is_dir() else 0o444)
        work.chmod(0o755)
        proc, port = await start_serve_as(65534 if os.geteuid() == 0 else None, cfg, work)
        try:
            base = f"http://127.0.0.1:{port}/v1/memories"
            status, err = await call("POST", base, SEED_WRITE, AUTH)
            msg = assert_shaped(status, err, 503, "store_unavailable")
            assert "read" in msg.lower() or "open" in msg.lower(), msg
        finally:
            proc.terminate()
            await proc.communicate()  # reads stderr to the end: its pipe is closed
    finally:
        for p in (work / "store", work):
            p.chmod(0o755)
        shutil.rmtree(work)


async def test_postgres_on_a_wrong_port_is_503_without_the_password(
    gateway: GatewayFactory
) -> None:
    """A PostgreSQL store nobody listens for answers a shaped 503 whose cause names no
    secret from the DSN; the gateway retries on the next request rather than giving up."""
    port = free_port()
    dsn = f"postgresql://memgate:hunter2-SECRET@127.0.0.1:{port}/test"
    gw = await gateway(store={"backend": "postgres"}, env={"MEMGATE_STORE_DSN": dsn})
    for _ in range(2):
        async with aiohttp.ClientSession() as s, s.post(
                f"{gw.url}/v1/memories", data=orjson.dumps(SEED_WRITE), headers=AUTH) as r:
            raw = await r.read()
            msg = assert_shaped(r.status, orjson.loads(raw), 503, "store_unavailable")
        assert b"hunter2" not in raw and str(port) in msg
    assert "hunter2" not in gw.log.getvalue()


@pytest.mark.parametrize(("dsn", "where"), [
    ("postgresql://memgate:hunter2-SECRET@127.0.0.1:54x2/test", "127.0.0.1:54x2"),
    ("postgresql://memgate:hunter2-SECRET@127.0.0.1:99999/test", "127.0.0.1:99999"),
    # passwords that break URL parsing: asyncpg's own error quotes a piece of them
    ("postgresql://app:hunter2/SECRET@127.0.0.1:5432/test", "127.0.0.1:5432"),
    ("postgresql://app:hunter2#SECRET@127.0.0.1:5432/test", "127.0.0.1:5432"),
    ("postgresql://app:hunter2?SECRET@127.0.0.1:5432/test", "127.0.0.1:5432"),
    ("postgresql://app:hunter2-SECRET@[::1:5432/test", "[::1:5432"),
])
async def test_postgres_dsn_it_cannot_read_is_503_without_the_password(
    gateway: GatewayFactory, dsn: str, where: str
) -> None:
    """A DSN asyncpg cannot read (a port that is not a number or too big, a password
    holding a bare / # ?, a broken IPv6 host) answers the same shaped 503 as a store
    that does not answer, not a 500, and no piece of the password reaches the answer,
    /readyz or the log (asyncpg's error said 'Sup3rSecret' of 'Sup3rSecret/x9')."""
    gw = await gateway(store={"backend": "postgres"}, env={"MEMGATE_STORE_DSN": dsn})
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{gw.url}/v1/memories", data=orjson.dumps(SEED_WRITE),
                          headers=AUTH) as r:
            raw = await r.read()
            msg = assert_shaped(r.status, orjson.loads(raw), 503, "store_unavailable")
        async with s.get(f"{gw.url}/readyz") as r:
            ready = await r.read()
    assert where in msg and "percent-encoded" in msg
    for seen in (raw, ready, gw.log.getvalue().encode()):
        assert b"hunter2" not in seen and b"SECRET" not in seen


def nested(body: dict[str, Any], key: str, depth: int = 1000) -> bytes:
    """`body` as JSON with body[key] an array nested `depth` deep (orjson parses 1,024
    levels but writes only 254, so the JSON is spliced)."""
    raw = orjson.dumps({**body, key: "@nest@"})
    return raw.replace(b'"@nest@"', b"[" * depth + b'"x"' + b"]" * depth)


@pytest.mark.parametrize("field", ["memory_id", "turn_id", "role", "memory_type", "agent_id",
                                   "session_id", "tags", "text", "ts"])
async def test_values_nested_1000_deep_are_400(gateway: GatewayFactory, tmp_path: Path,
                                               field: str) -> None:
    """A record field nested 1,000 deep (orjson parses it) is a 400 naming the field."""
    gw = await gateway(store={"path": str(tmp_path / "m.db")})
    status, err = await call("POST", f"{gw.url}/v1/memories", nested(SEED_WRITE, field), AUTH)
    msg = assert_shaped(status, err, 400, "invalid_record")
    assert field in msg and len(msg) < 300


@pytest.mark.parametrize("where", ["session_id", "agent_id", "tags", "memory_type", "time_from"])
async def test_filters_nested_1000_deep_are_400(gateway: GatewayFactory, tmp_path: Path,
                                                where: str) -> None:
    """The same for a search filter."""
    gw = await gateway(store={"path": str(tmp_path / "m.db")})
    raw = nested({"session_id": "s"}, where).replace(b"{", b'{"filter":{', 1) + b"}"
    status, err = await call("POST", f"{gw.url}/v1/memories/search", raw, AUTH)
    assert where in assert_shaped(status, err, 400, "invalid_filter")


@BACKENDS
async def test_timestamps_at_the_ends_of_the_calendar(
    gateway: GatewayFactory, tmp_path: Path, backend: str
) -> None:
    """Records dated year 1 and year 9999 (UTC) are stored and every read of them works;
    one whose UTC instant falls outside years 1-9999 is refused with a 400."""
    async with memory_gateway(gateway, backend, tmp_path) as base:
        ends = ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999Z",
                "0001-01-01T08:00:00+08:00"]
        ids = []
        for ts in ends:
            status, made = await call("POST", base, {**SEED_WRITE, "ts": ts}, AUTH)
            assert status == 201, made
            ids.append(made["memory_id"])
            status, got = await call("GET", f"{base}/{made['memory_id']}", headers=AUTH)
            assert status == 200 and got["ts"][:4] in ("0001", "9999")
        status, found = await call("POST", f"{base}/search", {
            "filter": {"session_id": "session-A", "time_from": "0001-01-01T00:00:00Z"},
            "top_k": 10, "query": "预算"}, AUTH)
        assert status == 200 and {r["memory_id"] for r in found["results"]} == set(ids)
        for ts in ("0001-01-01T00:00:00+08:00", "9999-12-31T23:59:59-08:00"):
            status, err = await call("POST", base, {**SEED_WRITE, "ts": ts}, AUTH)
            assert "years 1 to 9999" in assert_shaped(status, err, 400, "invalid_record")


@BACKENDS
async def test_nul_characters_are_refused(gateway: GatewayFactory, tmp_path: Path,
                                          backend: str) -> None:
    """NUL (which PostgreSQL text cannot hold) in ids, tags, filters or a path id is a 400
    on both backends; in a text it is stored as U+FFFD -- never a 500."""
    async with memory_gateway(gateway, backend, tmp_path) as base:
        for field, value in (("memory_id", "m\0"), ("session_id", "s\0"), ("agent_id", "\0"),
                             ("tags", ["t\0"]), ("turn_id", "1\0")):
            status, err = await call("POST", base, {**SEED_WRITE, field: value}, AUTH)
            assert field in assert_shaped(status, err, 400, "invalid_record")
        pair = {**SEED_WRITE, "text": None, "user_text": "u\0", "assistant_text": "a"}
        for body, key, want in (({**SEED_WRITE, "text": "a\0b"}, "text", "a\ufffdb"),
                                (pair, "user_text", "u\ufffd")):
            status, made = await call("POST", base, body, AUTH)
            assert status == 201
            got = (await call("GET", f"{base}/{made['memory_id']}", headers=AUTH))[1]
            assert got[key] == want
        for flt in ({"session_id": "s\0"}, {"session_id": "s", "tags": ["\0"]},
                    {"session_id": "s", "agent_id": "a\0"}):
            status, err = await call("POST", f"{base}/search", {"filter": flt}, AUTH)
            assert_shaped(status, err, 400, "invalid_filter")
        status, found = await call("POST", f"{base}/search", {
            "filter": {"session_id": "session-A"}, "query": "预算\0"}, AUTH)
        assert status == 200 and found["results"] == []  # a NUL in a query separates words
        for method in ("GET", "DELETE"):
            status, err = await call(method, f"{base}/m%00", headers=AUTH)
            assert "memory_id" in assert_shaped(status, err, 400, "invalid_request")


@BACKENDS
async def test_a_20k_word_query_is_bounded(gateway: GatewayFactory, tmp_path: Path,
                                           backend: str) -> None:
    """A 20,000-word query answers 200 quickly: only its first MAX_QUERY_TERMS distinct
    terms are searched (a term further on finds nothing)."""
    async with memory_gateway(gateway, backend, tmp_path) as base:
        await call("POST", base, {**SEED_WRITE, "text": "zebra 预算"}, AUTH)
        words = [f"w{i}" for i in range(20_000)]
        flt = {"session_id": "session-A", "time_from": "2026-11-01T00:00:00Z"}
        for query, hits in ((" ".join(["zebra", *words]), 1), (" ".join([*words, "zebra"]), 0),
                            (" ".join(words[:MAX_QUERY_TERMS - 1] + ["zebra"]), 1)):
            t0 = time.monotonic()
            status, found = await call("POST", f"{base}/search", {"filter": flt, "query": query},
                                       AUTH)
            assert status == 200 and len(found["results"]) == hits
            assert time.monotonic() - t0 < 5


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=20) | st.sampled_from(["turn", "user", "0001-01-01T00:00:00Z", "\0"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
def field(*good: Any) -> st.SearchStrategy[Any]:
    """Mostly a value the API accepts (so validation goes deep), else any JSON."""
    return st.one_of(st.sampled_from(good), json_values) if good else json_values


TS = ("2026-11-29T10:00:00Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999Z")
record_bodies = st.fixed_dictionaries({"session_id": field("s", "session-A")}, optional={
    "memory_id": field("m-1", "m-2"), "memory_type": field(*KINDS), "agent_id": field("a"),
    "turn_id": field(1, "t"), "role": field("user", "tool"), "text": field("预算 10 万"),
    "ts": field(*TS), "start_ts": field(*TS), "end_ts": field(*TS), "summary": field("s"),
    "tags": field(["budget"], []), "user_text": field("u"), "assistant_text": field("a"),
    "raw_messages_ref": field("k")})
search_bodies = st.fixed_dictionaries({
    "filter": st.fixed_dictionaries({"session_id": field("s")}, optional={
        "agent_id": field("a"), "time_from": field(*TS),
        "time_to": field(*TS), "tags": field(["budget"]), "memory_type": field(*KINDS)}),
}, optional={"query": field("预算 budget", ""), "top_k": field(1, 100, 0, 2**63 - 1),
             "scope": field("current", "cross_session")})


@pytest.fixture
async def fuzz_target(gateway: GatewayFactory, tmp_path: Path) -> AsyncIterator[
        tuple[aiohttp.ClientSession, str]]:
    gw = await gateway(store={"path": str(tmp_path / "m.db")})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        yield s, f"{gw.url}/v1/memories"


@pytest.mark.slow
@given(body=st.one_of(record_bodies, search_bodies, json_values,
                     st.builds(lambda r: {"records": r}, st.lists(record_bodies, max_size=3))),
       route=st.sampled_from(["", "/search"]))
@settings(max_examples=120,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
async def test_any_json_body_gets_a_shaped_answer_and_no_5xx(
    fuzz_target: tuple[aiohttp.ClientSession, str], body: Any, route: str
) -> None:
    """Fuzz: any JSON to the write or search route is answered 2xx or a shaped 4xx, never
    a 5xx, and the keep-alive connection serves the next request."""
    s, base = fuzz_target
    async with s.post(base + route, data=orjson.dumps(body), headers=AUTH) as r:
        answer = await r.json()
        assert r.status < 500, answer
        if r.status >= 400:
            assert_shaped(r.status, answer, r.status)
    async with s.get(f"{base}/none", headers=AUTH) as r:  # the same (only) connection
        assert r.status == 404


async def test_a_20k_word_question_recalls_from_postgres(gateway: GatewayFactory) -> None:
    """Recall on a chat request searches the store with the latest question: a 20,000-word
    one is answered 200 with its [mem] line (PostgreSQL failed 'stack depth limit exceeded')."""
    async with pg_schema() as (schema, _):
        budget = {"max_tokens": 1200, "max_chars": None, "max_messages": None,
                  "max_turns": None}
        gw = await gateway(memory={"enable_eviction": True, "budget": budget,
                                       "eviction": {"recall_share": 0}},
                           store={"backend": "postgres", "archive": "evicted",
                                  "recall": {"enabled": True, "top_k": 2}},
                           env={"MEMGATE_STORE_DSN": f"{PG_DSN}?options=-csearch_path%3D{schema}"})
        headers = {**AUTH, "X-Session-Id": "s-long"}
        msgs = conversation()
        url = f"{gw.url}/v1/chat/completions"
        assert (await call("POST", url, {"model": "gpt-4o-mini", "messages": msgs}, headers))[0] \
            == 200
        deadline = time.monotonic() + 10
        while not gw.state.memory.written and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert gw.state.memory.written > 0  # the store holds the evicted turns
        question = " ".join(f"word{i}" for i in range(20_000)) + " codename"
        msgs[-1] = {"role": "user", "content": question}
        status, _ = await call("POST", url, {"model": "gpt-4o-mini", "messages": msgs}, headers)
        assert status == 200
        assert len(await gw.wait_mem(2)) == 2
        await gw.server.close()


@BACKENDS
async def test_archived_turns_with_nul_and_a_long_agent_id_are_stored(
    gateway: GatewayFactory, tmp_path: Path, backend: str
) -> None:
    """A chat history whose turns hold NUL, sent with a 1,000-character X-Agent-Id, is
    answered and its evicted turns are archived (PostgreSQL refused NUL: archive_failed)."""
    budget = {"max_tokens": 1200, "max_chars": None, "max_messages": None, "max_turns": None}
    async with memory_gateway(gateway, backend, tmp_path,
                              memory={"enable_eviction": True, "budget": budget,
                                      "eviction": {"recall_share": 0}},
                              archive="evicted") as base:
        url = base.replace("/v1/memories", "/v1/chat/completions")
        msgs = conversation()
        msgs[1] = {"role": "user", "content": "the vault code is ZEBRA\u0000x"}
        headers = {**AUTH, "X-Session-Id": "s-nul", "X-Agent-Id": "a" * 1000}
        status, _ = await call("POST", url, {"model": "gpt-4o-mini", "messages": msgs}, headers)
        assert status == 200
        status, found = await call("POST", f"{base}/search", {
            "filter": {"session_id": "s-nul", "agent_id": "a" * 1000}, "query": "vault"}, AUTH)
        deadline = time.monotonic() + 10
        while not found.get("results") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # archiving is write-behind
            status, found = await call("POST", f"{base}/search", {
                "filter": {"session_id": "s-nul", "agent_id": "a" * 1000}, "query": "vault"},
                AUTH)
        assert status == 200 and "ZEBRA\ufffdx" in found["results"][0]["text"]


@pytest.mark.slow
async def test_a_sqlite_file_locked_by_another_writer_answers_503s_in_seconds(
    gateway: GatewayFactory, tmp_path: Path
) -> None:
    """Another process holds the store file's write lock (a backup, a second writer):
    a burst of memory-API writes answers 503 within a few seconds each, not one by one
    behind each other's 5 s waits (40 s for 12), and a config edit meanwhile is applied
    at once (the waits filled the default executor the reload reads the file in: 33 s);
    once the lock goes the API writes again."""
    db = tmp_path / "m.db"
    gw = await gateway(store={"path": str(db)})
    assert (await call("POST", f"{gw.url}/v1/memories", SEED_WRITE, AUTH))[0] == 201
    hold = 6.0
    locker = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "import sqlite3, sys, time\n"
        "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2])); db.execute('COMMIT')\n",
        str(db), str(hold), stdout=asyncio.subprocess.PIPE)
    try:
        assert locker.stdout is not None
        assert await locker.stdout.readline() == b"locked\n"
        t0 = time.monotonic()

        async def write(k: int) -> tuple[int, float]:
            status, _ = await call("POST", f"{gw.url}/v1/memories",
                                   {**SEED_WRITE, "turn_id": f"t-lock-{k}"}, AUTH)
            return status, time.monotonic() - t0

        burst = asyncio.gather(*(write(k) for k in range(12)))
        await asyncio.sleep(0.2)
        text = gw.config.read_text()
        assert "enable_eviction: false" in text
        gw.config.write_text(text.replace("enable_eviction: false", "enable_eviction: true"))
        while "config_reload result=ok" not in gw.log.getvalue():
            assert time.monotonic() - t0 < 2.0, "the reload waited on the store"
            await asyncio.sleep(0.05)
        answers = await burst
        assert [s for s, _ in answers] == [503] * 12
        assert max(t for _, t in answers) < 3.0, answers
        await locker.wait()
        deadline = time.monotonic() + 5.0
        while (await call("POST", f"{gw.url}/v1/memories",
                          {**SEED_WRITE, "turn_id": "t-after"}, AUTH))[0] != 201:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.3)
    finally:
        if locker.returncode is None:
            locker.kill()
            await locker.wait()


@pytest.mark.slow
async def test_a_postgres_that_hangs_costs_one_connect_timeout_not_one_per_call(
    gateway: GatewayFactory
) -> None:
    """A PostgreSQL that accepts and never answers: 6 memory-API calls at once all answer
    503 after the one connect timeout their shared open waited (they answered at 5, 10,
    ... 30 s, each retrying the open behind the last); a later call tries again."""
    from gateway.memory.store.postgres import CONNECT_TIMEOUT_S

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # until the client gives up
        finally:
            writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await gateway(store={"backend": "postgres"}, env={
            "MEMGATE_STORE_DSN": f"postgresql://memgate@127.0.0.1:{port}/test"})
        t0 = time.monotonic()

        async def one(k: int) -> tuple[int, float]:
            status, err = await call("POST", f"{gw.url}/v1/memories",
                                     {**SEED_WRITE, "turn_id": f"t-{k}"}, AUTH)
            assert_shaped(status, err, 503, "store_unavailable")
            return status, time.monotonic() - t0

        answers = await asyncio.gather(*(one(k) for k in range(6)))
        assert max(t for _, t in answers) < CONNECT_TIMEOUT_S + 2, answers
    finally:
        server.close()
