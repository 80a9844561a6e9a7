#!/usr/bin/env python3
"""Bounded soak: many concurrent clients, stream and non-stream, eviction on (loopback only).

    python tests/perf/soak.py [--seconds 60] [--clients 200]
    python tests/perf/soak.py --requests 100000 --sessions 10000   # memory bound
    python tests/perf/soak.py --sustained --seconds 30 --linger 65  # RSS per third


Starts a fast local upstream (JSON and SSE) and memgate with eviction on, runs
`--clients` concurrent clients for `--seconds` (half streaming), and reports
errors, requests, and the gateway's RSS and open file descriptors at the start
and the end (a leak shows as growth). With --requests/--sessions it instead
sends that many requests spread over that many distinct sessions (distinct
histories) and prints RSS every tenth of the way, next to the configured cache
bounds: RSS must level off, not grow with the number of sessions. Stops
everything by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import Proc, body, free_port, history  # noqa: E402

UPSTREAM = """
import sys
from aiohttp import web
JSON = (b'{"id":"x","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
        b'"finish_reason":"stop","message":{"role":"assistant","content":"ok"}}]}')
async def h(r):
    data = await r.read()
    if b'"stream":true' in data:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(r)
        for i in range(5):
            await resp.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\\n\\n')
        await resp.write(b"data: [DONE]\\n\\n")
        await resp.write_eof()
        return resp
    return web.Response(body=JSON, content_type="application/json")
app = web.Application(client_max_size=1 << 30)
app.router.add_route("*", "/{t:.*}", h)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def post_ok(s: aiohttp.ClientSession, url: str, data: bytes, session: str) -> bool:
    """POST one chat body for `session`; True on HTTP 200 (an error or a failed
    connection is False)."""
    try:
        async with s.post(url, data=data, headers={"Content-Type": "application/json",
                                                   "X-Session-Id": session}) as r:
            await r.read()
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def run(url: str, seconds: float, clients: int) -> tuple[int, int]:
    ok = errors = 0
    end = time.monotonic() + seconds
    plain = body(history(80))
    stream = orjson.dumps({**orjson.loads(plain), "stream": True})

    async def client(k: int) -> None:
        nonlocal ok, errors
        n = 0
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                data = (stream if k % 2 else plain).replace(b"and now?", f"{k}-{n}?".encode())
                good = await post_ok(s, url, data, f"soak-{k}")
                ok, errors = ok + good, errors + (not good)
                n += 1

    await asyncio.gather(*(client(k) for k in range(clients)))
    return ok, errors


def upstream_sockets(port: int) -> int:
    """Established TCP connections to the upstream's port (the gateway's pool)."""
    rem = f":{port:04X}"
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            n += f[2].endswith(rem) and f[3] == "01"
    return n


async def sustained(url: str, seconds: float, clients: int, pid: int
                    ) -> tuple[int, int, list[tuple[float, float]]]:
    """One load of `seconds`, the gateway's RSS sampled every half second."""
    samples: list[tuple[float, float]] = []

    async def sample() -> None:
        t0 = time.monotonic()
        while True:
            samples.append((time.monotonic() - t0, rss_mb(pid)))
            await asyncio.sleep(0.5)

    task = asyncio.ensure_future(sample())
    try:
        ok, errors = await run(url, seconds, clients)
    finally:
        task.cancel()
    return ok, errors, samples


async def spread(url: str, start: int, stop: int, sessions: int, clients: int
                 ) -> tuple[int, int]:
    """Requests start..stop of a run over `sessions` sessions, each a distinct history
    that grows by one message every time the session comes round again."""
    ok = errors = 0
    bases = [history(60, seed=i) for i in range(50)]
    counter = iter(range(start, stop))

    async def client() -> None:
        nonlocal ok, errors
        async with aiohttp.ClientSession() as s:
            for n in counter:
                sid = n % sessions
                msgs = [{"role": "user", "content": f"session {sid}: start"},
                        *bases[sid % len(bases)], *[{"role": "user", "content": f"{sid} q{t}"}
                                                    for t in range(n // sessions)]]
                data = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
                good = await post_ok(s, url, data, f"spread-{sid}")
                ok, errors = ok + good, errors + (not good)

    await asyncio.gather(*(client() for _ in range(clients)))
    return ok, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--requests", type=int, default=0, help="memory-bound mode: requests")
    ap.add_argument("--sessions", type=int, default=10_000, help="... over this many sessions")
    ap.add_argument("--sustained", action="store_true",
                    help="one load of --seconds: RSS per third, upstream sockets after it")
    ap.add_argument("--linger", type=float, default=0,
                    help="with --sustained: then idle this long and count the sockets again")
    args = ap.parse_args()
    up = Proc([sys.executable, "-c", UPSTREAM, str(p := free_port())], p)
    port = free_port()
    gw = Proc([sys.executable, "-m", "gateway", "serve", "--port", str(port), "--upstream",
               f"http://127.0.0.1:{up.port}"], port,
              {"MEMGATE_ENABLE_EVICTION": "1", "MEMGATE_LOG_FORMAT": "json"})
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(run(url, 3, 10))  # warm-up
        print(f"start: gateway RSS {rss_mb(gw.p.pid):.1f} MB, open fds {fds(gw.p.pid)}")
        if args.requests:
            from gateway.config.resources import default_config
            from gateway.config.rules import load_rules

            cfg = default_config(None, os.environ)
            r = load_rules(cfg, os.environ)
            print(f"bounds ({cfg}): session.history_cache_mb {r.history_cache_mb}, "
                  f"session.max_tracked {r.max_tracked_sessions}, tokens.cache_size "
                  f"{r.token_cache_size} entries")
            step = args.requests // 10
            done = 0
            t0 = time.monotonic()
            while done < args.requests:
                ok, errors = asyncio.run(spread(url, done, done + step, args.sessions, 32))
                done += step
                print(f"{done:>7} requests ({ok} ok, {errors} errors, "
                      f"{done / (time.monotonic() - t0):.0f} req/s): gateway RSS "
                      f"{rss_mb(gw.p.pid):.1f} MB, open fds {fds(gw.p.pid)}", flush=True)
            return
        if args.sustained:
            ok, errors, samples = asyncio.run(sustained(url, args.seconds, args.clients,
                                                        gw.p.pid))
            thirds = [[r for t, r in samples if k * args.seconds / 3 <= t
                       < (k + 1) * args.seconds / 3] for k in range(3)]
            print(f"{args.clients} clients, {args.seconds:.0f} s: {ok} ok, {errors} errors")
            for k, rs in enumerate(thirds):
                if rs:
                    print(f"third {k + 1}: RSS {rs[0]:.1f} -> {rs[-1]:.1f} MB "
                          f"(max {max(rs):.1f}, growth {rs[-1] - rs[0]:+.1f})")
            print(f"after: upstream sockets {upstream_sockets(up.port)}, "
                  f"open fds {fds(gw.p.pid)}")
            if args.linger:
                time.sleep(args.linger)
                print(f"after {args.linger:.0f} s idle: upstream sockets "
                      f"{upstream_sockets(up.port)}, open fds {fds(gw.p.pid)}, "
                      f"RSS {rss_mb(gw.p.pid):.1f} MB")
            return
        # two rounds: caches and the upstream keep-alive pool fill in the first; a leak
        # would keep growing in the second
        for rnd in (1, 2):
            t0 = time.monotonic()
            ok, errors = asyncio.run(run(url, args.seconds / 2, args.clients))
            took = time.monotonic() - t0
            time.sleep(1)
            print(f"round {rnd}: {args.clients} clients, {took:.0f} s: {ok} ok, {errors} errors,"
                  f" {ok / took:.0f} req/s; gateway RSS {rss_mb(gw.p.pid):.1f} MB, "
                  f"open fds {fds(gw.p.pid)}")
    finally:
        gw.stop()
        up.stop()


if __name__ == "__main__":
    main()
