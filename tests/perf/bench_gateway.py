#!/usr/bin/env python3
"""memgate vs a bare aiohttp passthrough, same fast local upstream, one run (loopback only).

    python tests/perf/bench_gateway.py [--seconds 3] [--baseline /work/main] [--no-key]

Starts a fixed-answer upstream, a bare aiohttp passthrough and memgate (eviction
off, then on with a budget that evicts medium and larger payloads) as separate
processes, and reports per payload size the p50 latency at concurrency 1, the
throughput at concurrency 16 and the target's CPU time per request under that
load (the steadiest of the three on a shared machine) as ratios against the
passthrough measured in the same run, and memgate's own time before forwarding
(`overhead_ms` of its [mem] lines: what a client waiting on a real LLM pays;
the latency above also holds the bookkeeping after each fast answer); then a
growing session (gateway CPU per request at turn 10 vs turn 1,000, warm) and a
cold 1 MB history (time to first byte, nothing cached). `--baseline DIR` adds
memgate-on run from another checkout (its `gateway` package, e.g. the main branch's)
as `baseline-on`, measured in the same rounds, and reports memgate-on against it.
Then the same payloads one at a time to an upstream that takes `--paced-ms` (20) to
answer, as a model does: the gateway idles between requests and finds its caches cold,
which is what a client of a real LLM pays (on a shared 2-core machine, 3-5x the times
with an instant upstream).
Every request carries `Authorization: Bearer sk-bench`, as an SDK's do: the caller is a
tenant and its session's history is remembered; `--no-key` measures a caller without a
key (no tenant, every request parsed and counted cold). Bounded in time; everything
stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parents[2]
REPLY = orjson.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "ok"}}]})
UPSTREAM = f"""
import asyncio
from aiohttp import web
async def h(r):
    await r.read()
    delay = float(r.headers.get("X-Bench-Delay-Ms", 0))  # a model's time to answer
    if delay:
        await asyncio.sleep(delay / 1000)
    return web.Response(body={REPLY!r}, content_type="application/json")
app = web.Application(client_max_size=1 << 30)
app.router.add_route("*", "/{{t:.*}}", h)
web.run_app(app, host="127.0.0.1", port=int(__import__("sys").argv[1]), print=None,
            access_log=None)
"""
PASSTHROUGH = """
import sys
from aiohttp import ClientSession, TCPConnector, web
UP = sys.argv[2]
HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}
async def proxy(request):
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    async with request.app["s"].request(request.method, UP + request.path_qs, data=body,
                                        headers=headers) as up:
        resp = web.StreamResponse(status=up.status)
        for k, v in up.headers.items():
            if k.lower() not in HOP:
                resp.headers.add(k, v)
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp
async def start(app):
    app["s"] = ClientSession(connector=TCPConnector(limit=0), auto_decompress=False)
async def stop(app):
    await app["s"].close()
app = web.Application(client_max_size=1 << 30)
app.on_startup.append(start)
app.on_cleanup.append(stop)
app.router.add_route("*", "/{t:.*}", proxy)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""
SIZES = {"small": 10, "medium": 60, "large": 300, "huge": 1500}
# what every request sends: a key, as the SDKs always do (a caller with a key is a tenant,
# whose session the gateway remembers); --no-key drops it (no tenant: nothing is remembered)
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def history(n: int, seed: int = 1) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    words = "gateway token cache stream tool result 订单 汇总 budget history evict".split()
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful. " * 20}]
    while len(msgs) < n:
        t = len(msgs)
        msgs.append({"role": "user", "content": " ".join(rnd.choices(words, k=60)) + f" #{t}"})
        if t % 4 == 1:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{t}", "type": "function",
                 "function": {"name": "read", "arguments": '{"p": "/src/x.py"}'}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{t}",
                         "content": " ".join(rnd.choices(words, k=200))})
        msgs.append({"role": "assistant", "content": " ".join(rnd.choices(words, k=80))})
    return msgs[:n] if msgs[n - 1]["role"] != "tool" else msgs[: n - 2]


def body(msgs: list[dict[str, Any]], tag: str = "") -> bytes:
    return orjson.dumps({"model": "gpt-4o-mini", "messages": [
        *msgs, {"role": "user", "content": f"{tag} and now?"}]})


class Proc:
    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None,
                 log: Path | None = None, cwd: Path | None = None) -> None:
        self.port = port
        self.log = log  # the target's stderr: memgate's JSON log lines
        err = log.open("wb") if log is not None else subprocess.DEVNULL
        self.p = subprocess.Popen(args, env={**os.environ, **(env or {})},
                                  stdout=subprocess.DEVNULL, stderr=err,
                                  start_new_session=True, cwd=cwd)
        if log is not None:
            err.close()  # the child holds its own copy
        deadline = time.time() + 30
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"{args} did not start")

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log is not None else 0

    def overhead_ms(self, since: int, q: float = 0.5) -> float:
        """The q-quantile (median by default) of `overhead_ms` (time before forwarding)
        of the [mem] lines written after byte `since` of the log."""
        assert self.log is not None
        with self.log.open("rb") as f:
            f.seek(since)
            vals = sorted(ev["overhead_ms"] for ev in map(orjson.loads, f.read().splitlines())
                          if ev.get("event") == "mem")
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        os.killpg(self.p.pid, signal.SIGTERM)
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)


async def latency(url: str, payload: bytes, seconds: float, delay_ms: float = 0.0) -> float:
    """Median time to the whole answer, one request at a time; with `delay_ms` the
    upstream takes that long to answer, as a model does (the gateway idles meanwhile)."""
    samples: list[float] = []
    headers = {**HEADERS, "X-Bench-Delay-Ms": str(delay_ms)} if delay_ms else HEADERS
    async with aiohttp.ClientSession() as s:
        end = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < end:
            data = payload.replace(b"and now?", f"and now {n}?".encode())
            t0 = time.perf_counter()
            async with s.post(url, data=data, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            samples.append(time.perf_counter() - t0)
            n += 1
    return statistics.median(samples) * 1000


async def throughput(url: str, payload: bytes, seconds: float, conc: int = 16) -> float:
    done = 0
    end = time.perf_counter() + seconds

    async def worker(s: aiohttp.ClientSession, k: int) -> None:
        nonlocal done
        n = 0
        while time.perf_counter() < end:
            data = payload.replace(b"and now?", f"and now {k}-{n}?".encode())
            async with s.post(url, data=data, headers=HEADERS) as r:
                await r.read()
            done += 1
            n += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s, k) for k in range(conc)))
    return done / seconds


async def ttfb(url: str, payload: bytes) -> float:
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(url, data=payload, headers=HEADERS) as r:
            await r.content.readany()
            return (time.perf_counter() - t0) * 1000


def paced(targets: dict[str, Proc], payloads: dict[str, bytes], delay_ms: float,
          seconds: float, hot: dict[str, float]) -> None:
    """One request at a time to an upstream that answers after `delay_ms`, as a model
    does: between requests the gateway idles and the machine's other work takes its
    caches, so each request finds them cold. What a client of a real LLM pays; the
    table above (an upstream that answers at once, the gateway never idle) is the floor."""
    print(f"\nLLM-paced upstream (answers after {delay_ms:g} ms, as a model does; one request"
          " at a time): the gateway idles between requests, its caches go cold")
    print(f"{'payload':<8} | {'on minus pt ms':>14} | {'on overhead_ms p50':>18} {'p99':>6}"
          f" | {'with an instant upstream p50':>28}")
    for name, payload in payloads.items():
        lat: dict[str, float] = {}
        on, since = targets["memgate-on"], 0
        for t in ("passthrough", "memgate-on"):
            url = f"http://127.0.0.1:{targets[t].port}/v1/chat/completions"
            asyncio.run(latency(url, payload, 0.3, delay_ms))  # warm-up: out of the load phase
            if t == "memgate-on":
                since = on.log_size()
            lat[t] = asyncio.run(latency(url, payload, seconds, delay_ms))
        print(f"{name:<8} | {lat['memgate-on'] - lat['passthrough']:>+14.3f} | "
              f"{on.overhead_ms(since):>18.3f} {on.overhead_ms(since, 0.99):>6.3f} | "
              f"{hot.get(name, float('nan')):>28.3f}")


def console_config(where: Path) -> Path:
    """rules/gateway.yaml (what memgate-on serves) with the console on, its files absolute."""
    import yaml

    data = yaml.safe_load((ROOT / "rules" / "gateway.yaml").read_text(encoding="utf-8"))
    carry = data.get("memory", {}).get("carry")
    if isinstance(carry, dict) and "rules_file" in carry:
        carry["rules_file"] = str(ROOT / "rules" / carry["rules_file"])
    tokens = data.setdefault("tokens", {})
    if "models_file" in tokens:
        tokens["models_file"] = str(ROOT / "rules" / tokens["models_file"])
    data["console"] = {"enabled": True}
    path = where / "console.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--console", action="store_true",
                    help="also memgate-on with the operator console on (console.enabled)")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a checkout whose memgate-on is measured beside this one's")
    ap.add_argument("--no-key", action="store_true",
                    help="send no Authorization header: a caller without a tenant, whose "
                         "requests the gateway remembers nothing of (each is parsed cold)")
    ap.add_argument("--paced-ms", type=float, default=20.0,
                    help="the paced phase's upstream answers after this long (0: no phase)")
    args = ap.parse_args()
    if args.no_key:
        del HEADERS["Authorization"]
    py = sys.executable
    up = Proc([py, "-c", UPSTREAM, str(port := free_port())], port)
    upstream = f"http://127.0.0.1:{up.port}"
    procs = [up]
    logs = tempfile.TemporaryDirectory(prefix="memgate-bench-")
    try:
        pt = Proc([py, "-c", PASSTHROUGH, str(p := free_port()), upstream], p)
        procs.append(pt)
        targets = {"passthrough": pt}
        runs = [("memgate-off", {"MEMGATE_ENABLE_EVICTION": "0"}, ROOT),
                ("memgate-on", {"MEMGATE_ENABLE_EVICTION": "1"}, ROOT)]
        if args.baseline is not None:  # `-m gateway` imports from the working directory
            runs.append(("baseline-on", {"MEMGATE_ENABLE_EVICTION": "1",
                                         "PYTHONPATH": str(args.baseline)}, args.baseline))
        for name, env, where in runs:
            port = free_port()
            targets[name] = Proc([py, "-m", "gateway", "serve", "--port", str(port),
                                  "--upstream", upstream], port, {**env, "MEMGATE_LOG_FORMAT":
                                                                  "json"},
                                 log=Path(logs.name) / f"{name}.log", cwd=where)
            procs.append(targets[name])
        if args.console:  # the same config as memgate-on, with the console observing
            port = free_port()
            targets["on+console"] = Proc(
                [py, "-m", "gateway", "serve", "--port", str(port), "--upstream", upstream,
                 "--config", str(console_config(Path(logs.name)))], port,
                {"MEMGATE_ENABLE_EVICTION": "1", "MEMGATE_LOG_FORMAT": "json"},
                log=Path(logs.name) / "on+console.log")
            procs.append(targets["on+console"])
        payloads = {k: body(history(n)) for k, n in SIZES.items()}
        print(f"{'payload':<8} {'bytes':>9} | " + " | ".join(
            f"{t:>11} p50 ms  rps" for t in targets)
            + " | on/pt p50  on/pt rps  on/pt cpu  off/pt p50  on pre-forward ms"
            + ("  console/on p50  rps  cpu  pre-forward ms" if args.console else "")
            + ("  on/base p50  cpu  base pre-forward ms" if args.baseline else ""))
        hot_overhead: dict[str, float] = {}
        for name, payload in payloads.items():
            row = {}
            pre_forward = {t: float("nan") for t in targets}
            for t, proc in targets.items():
                url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
                asyncio.run(latency(url, payload, 0.5))  # warm-up
                since = proc.log_size()
                lat = asyncio.run(latency(url, payload, args.seconds))
                if t in ("memgate-on", "on+console", "baseline-on"):  # what a client waiting
                    # on an LLM pays
                    pre_forward[t] = proc.overhead_ms(since)
                c0 = proc.cpu_s()
                rps = asyncio.run(throughput(url, payload, args.seconds))
                # the target's CPU per request under load: steadier than latency on a busy box
                row[t] = (lat, rps, (proc.cpu_s() - c0) / max(1.0, rps * args.seconds))
            hot_overhead[name] = pre_forward["memgate-on"]
            pt_l, pt_r, pt_c = row["passthrough"]
            on_l, on_r, on_c = row["memgate-on"]
            print(f"{name:<8} {len(payload):>9} | " + " | ".join(
                f"{lat:>11.3f} {rps:>8.0f}" for lat, rps, _ in row.values())
                + f" | {on_l / pt_l:>9.2f} {on_r / pt_r:>10.2f} {on_c / pt_c:>10.2f}"
                  f" {row['memgate-off'][0] / pt_l:>11.2f} {pre_forward['memgate-on']:>18.3f}"
                + (f"  {row['on+console'][0] / on_l:>14.2f} {row['on+console'][1] / on_r:>4.2f}"
                   f" {row['on+console'][2] / on_c:>4.2f} {pre_forward['on+console']:>15.3f}"
                   if args.console else "")
                + (f"  {on_l / row['baseline-on'][0]:>11.2f} {on_c / row['baseline-on'][2]:>4.2f}"
                   f" {pre_forward['baseline-on']:>18.3f}" if args.baseline else ""))
        if args.paced_ms:
            paced(targets, payloads, args.paced_ms, args.seconds,
                  {n: hot for n, hot in hot_overhead.items()})
        print("\ngrowing session, warm: CPU per request, each request = the previous history"
              " + one turn (5 warm-up requests, then 100 measured); every user turn names a"
              " file of its own, as an agent's do")
        for turns in (10, 100, 1000):
            cpu = []
            extra = [*(["on+console"] if args.console else []),
                     *(["baseline-on"] if args.baseline else [])]
            names = ["passthrough", "memgate-on", *extra]
            for name in names:
                proc = targets[name]
                u = f"http://127.0.0.1:{proc.port}/v1/chat/completions"

                async def grow(h: list[dict[str, Any]], n: int, u: str = u,
                               turns: int = turns) -> None:
                    async with aiohttp.ClientSession() as s:
                        for k in range(n):
                            h += [{"role": "user", "content": f"step {k}: /src/new{k}/m.py"},
                                  {"role": "assistant", "content": f"done {k}"}]
                            async with s.post(u, data=body(h), headers={
                                    **HEADERS, "X-Session-Id": f"grow-{turns}"}) as r:
                                await r.read()

                h = [dict(m, content=f"{m['content']} /src/m{i}/f{i}.py")
                     if m["role"] == "user" else m for i, m in enumerate(history(turns * 2,
                                                                                 seed=turns))]
                asyncio.run(grow(h, 5))
                c0 = proc.cpu_s()
                asyncio.run(grow(h, 100))
                cpu.append((proc.cpu_s() - c0) / 100 * 1000)
            print(f"  turn {turns:>5} ({turns * 2:>5} messages): passthrough {cpu[0]:.2f} ms, "
                  f"memgate-on {cpu[1]:.2f} ms, memgate-on minus passthrough "
                  f"{cpu[1] - cpu[0]:.2f} ms"
                  + "".join(f", {t} {c:.2f} ms ({t}/on {c / cpu[1]:.2f})"
                            for t, c in zip(extra, cpu[2:])))
        print("\ncold 1 MB history (nothing cached): time to first byte, median ms\n"
              "  (spaced: 0.5 s apart, the previous one's [mem] counting done; back to back:"
              " each\n  request meets the previous one's off-the-request-path counting)")
        cold = {t: {"spaced": [], "back to back": []} for t in targets}
        for r in range(10):  # targets interleaved: the box's drift hits them alike
            for k, (t, proc) in enumerate(targets.items()):
                u = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
                seed = 100 + 100 * r + 10 * k
                time.sleep(0.5)
                cold[t]["spaced"].append(asyncio.run(ttfb(u, body(history(1500, seed), "s"))))
                if r < 3:
                    cold[t]["back to back"] += [asyncio.run(ttfb(u, body(history(1500, seed + i),
                                                                       "b")))
                                                for i in range(1, 6)]
        for kind in ("spaced", "back to back"):
            base = statistics.median(cold["passthrough"][kind])
            print(f"  {kind:<12} " + "  ".join(
                f"{t} {statistics.median(v[kind]):7.2f}" for t, v in cold.items())
                + f"  | on minus passthrough "
                  f"{statistics.median(cold['memgate-on'][kind]) - base:+.2f}")
    finally:
        for p in procs:
            p.stop()
        logs.cleanup()


if __name__ == "__main__":
    main()
