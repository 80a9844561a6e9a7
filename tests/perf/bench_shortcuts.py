#!/usr/bin/env python3
"""What each request-path shortcut buys (not a test: a benchmark to read).

    python -m tests.perf.bench_shortcuts [--rounds 3] [--seconds 1]

Runs memgate with every shortcut on and with each one off (MEMGATE_SHORTCUTS_OFF=
history | splice | spans | prefilter | deferred | thread), eviction on and eviction off
(shadow), all as separate processes in front of one fixed-answer upstream, and
measures the workloads of tests/perf/bench_gateway.py in interleaved rounds (every
target once per round, so the shared machine's drift hits them alike):

- medium / large payloads: `overhead_ms` p50 and p99 of the [mem] lines at
  concurrency 1, CPU per request under concurrency 16;
- a growing session (each request = the previous history + one turn, 600 messages):
  CPU per request;
- a cold 1 MB history (nothing cached): time to first byte and CPU per request;
- the process's RSS at the end.

Reported per target as the median over rounds, and as the ratio off / all-on (> 1:
the shortcut saves that much). The in-process benchmarks are run the same way:
bench_plan's `session+1` and `cold` with the history cache and the prefilter off
(bench_forward times Wire.build_body, which no shortcut touches).
Bounded in time; everything stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from tests.perf.bench_gateway import UPSTREAM, Proc, body, free_port, history

SHORTCUTS = ("history", "splice", "spans", "prefilter", "deferred", "thread")
MODES = {"on": "1", "off": "0"}  # MEMGATE_ENABLE_EVICTION (off: shadow, the shipped default)
PAYLOADS = {"medium": 60, "large": 300}
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}


def overheads(proc: Proc, since: int) -> list[float]:
    """`overhead_ms` of the [mem] lines written after byte `since` of the log (the last
    ones follow their responses: waited for briefly)."""
    assert proc.log is not None
    time.sleep(0.2)
    with proc.log.open("rb") as f:
        f.seek(since)
        lines = f.read().splitlines()
    out = []
    for line in lines:
        try:
            ev = orjson.loads(line)
        except orjson.JSONDecodeError:  # a line still being written
            continue
        if ev.get("event") == "mem":
            out.append(float(ev["overhead_ms"]))
    return out


def rss_mb(proc: Proc) -> float:
    for line in Path(f"/proc/{proc.p.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def sequential(url: str, bodies: list[bytes], session: str) -> list[float]:
    """Each body once, one after the other; time to first byte of each (ms)."""
    out = []
    async with aiohttp.ClientSession() as s:
        for data in bodies:
            t0 = time.perf_counter()
            async with s.post(url, data=data, headers={**HEADERS, "X-Session-Id": session}) as r:
                await r.content.readany()
                out.append((time.perf_counter() - t0) * 1000)
                await r.read()
    return out


async def loaded(url: str, payload: bytes, seconds: float, conc: int = 16) -> int:
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
    return done


def pct(vals: list[float], q: float) -> float:
    if not vals:
        return float("nan")
    vals = sorted(vals)
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def one_round(proc: Proc, r: int, k: int, seconds: float,
              payloads: dict[str, bytes]) -> dict[str, float]:
    url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
    got: dict[str, float] = {}
    for name, payload in payloads.items():
        n = max(20, int(seconds * 200))
        bodies = [payload.replace(b"and now?", f"and now {r}-{i}?".encode()) for i in range(n)]
        asyncio.run(sequential(url, bodies[:5], f"warm-{name}"))
        since = proc.log_size()
        asyncio.run(sequential(url, bodies, f"c1-{name}"))
        vals = overheads(proc, since)
        got[f"{name} p50"], got[f"{name} p99"] = pct(vals, 0.5), pct(vals, 0.99)
        c0 = proc.cpu_s()
        done = asyncio.run(loaded(url, payload, seconds))
        got[f"{name} cpu"] = (proc.cpu_s() - c0) / max(1, done) * 1000
    # a growing session: 600 messages, then one turn per request (each user turn names a
    # file of its own, as an agent's do)
    h = [dict(m, content=f"{m['content']} /src/m{i}/f{i}.py") if m["role"] == "user" else m
         for i, m in enumerate(history(600, seed=300 + r))]
    grown = []
    for i in range(35):
        h = [*h, {"role": "user", "content": f"step {i}: /src/new{i}/m.py"},
             {"role": "assistant", "content": f"done {i}"}]
        grown.append(body(h))
    asyncio.run(sequential(url, grown[:5], f"grow-{r}"))
    c0 = proc.cpu_s()
    asyncio.run(sequential(url, grown[5:], f"grow-{r}"))
    got["grow cpu"] = (proc.cpu_s() - c0) / 30 * 1000
    # cold 1 MB histories, spaced (the previous one's counting done)
    ttfb, cpu = [], []
    for i in range(3):
        time.sleep(0.3)
        c0 = proc.cpu_s()
        ttfb += asyncio.run(sequential(url, [body(history(1500, 1000 * r + 10 * k + i), "c")],
                                       f"cold-{r}-{k}-{i}"))
        time.sleep(0.3)  # its [mem] accounting done
        cpu.append((proc.cpu_s() - c0) * 1000)
    got["cold ttfb"], got["cold cpu"] = statistics.median(ttfb), statistics.median(cpu)
    got["rss MB"] = rss_mb(proc)
    return got


def http_bench(rounds: int, seconds: float) -> None:
    py = sys.executable
    up = Proc([py, "-c", UPSTREAM, str(port := free_port())], port)
    upstream = f"http://127.0.0.1:{up.port}"
    procs = [up]
    logs = tempfile.TemporaryDirectory(prefix="memgate-shortcuts-")
    targets: dict[tuple[str, str], Proc] = {}
    try:
        for mode, flag in MODES.items():
            for off in ("", *SHORTCUTS):
                port = free_port()
                targets[(mode, off)] = Proc(
                    [py, "-m", "gateway", "serve", "--port", str(port), "--upstream", upstream],
                    port, {"MEMGATE_ENABLE_EVICTION": flag, "MEMGATE_LOG_FORMAT": "json",
                           "MEMGATE_SHORTCUTS_OFF": off},
                    log=Path(logs.name) / f"{mode}-{off or 'none'}.log")
                procs.append(targets[(mode, off)])
        payloads = {k: body(history(n)) for k, n in PAYLOADS.items()}
        results: dict[tuple[str, str], list[dict[str, float]]] = {t: [] for t in targets}
        for r in range(rounds):
            order = list(targets.items())
            if r % 2:
                order.reverse()  # neither end of a round is always the same target's
            for k, (t, proc) in enumerate(order):
                results[t].append(one_round(proc, r, k, seconds, payloads))
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        report(results)
    finally:
        for p in procs:
            p.stop()
        logs.cleanup()


def report(results: dict[tuple[str, str], list[dict[str, float]]]) -> None:
    keys = list(next(iter(results.values()))[0])
    med = {t: {key: statistics.median(r[key] for r in rs) for key in keys}
           for t, rs in results.items()}
    print("\nmedians over rounds (ms; cpu = CPU ms per request; p50/p99 = overhead_ms)")
    print(f"{'eviction':<8} {'off':<10} " + " ".join(f"{k:>11}" for k in keys))
    for (mode, off), m in med.items():
        print(f"{mode:<8} {off or '(none)':<10} " + " ".join(f"{m[k]:>11.3f}" for k in keys))
    print("\nratio shortcut off / all on (> 1: what the shortcut saves)")
    print(f"{'eviction':<8} {'off':<10} " + " ".join(f"{k:>11}" for k in keys))
    for (mode, off), m in med.items():
        if off:
            base = med[(mode, "")]
            print(f"{mode:<8} {off:<10} " + " ".join(
                f"{m[k] / base[k] if base[k] else float('nan'):>11.2f}" for k in keys))


def plan_bench(rounds: int) -> None:
    """bench_plan's session+1 (the grown request of a cached session) and cold decide,
    with the history cache and the prefilter each off."""
    from gateway.config.env_overrides import apply_env
    from gateway.config.rules import build_rules
    from gateway.decide.chat import decide
    from gateway.decide.history import HistoryCache
    from gateway.measure.tokens import Tokenizers
    from gateway.policy.carry.snapshot import EXTRACTED
    from tests.perf.bench_plan import ROOT
    from tests.perf.bench_plan import history as plan_history

    base = build_rules({"memory": {"enable_eviction": True, "budget": {
        "max_tokens": 6000, "max_chars": None, "max_messages": None, "max_turns": None},
        "carry": {"enabled": True, "rules_file": "rules/carry.yaml"}},  # as shipped
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
    variants = {off: apply_env(base, {"MEMGATE_SHORTCUTS_OFF": off})
                for off in ("", "history", "prefilter")}
    print("\nin process (bench_plan), median ms; ratio off / all on")
    for n in (300, 2000):
        msgs = plan_history(n)
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        samples: dict[str, dict[str, list[float]]] = {v: {"cold": [], "session+1": []}
                                                      for v in variants}
        for r in range(rounds * 5):
            for off, rules in variants.items():
                tok = Tokenizers(200_000)
                EXTRACTED.clear()  # cold: no message's extraction cached
                cache = None if off == "history" else HistoryCache(1 << 30, 16)
                t0 = time.process_time()
                decide(raw, orjson.loads(raw), rules, tok, history=cache, key=("t", "s"))
                samples[off]["cold"].append(time.process_time() - t0)
                grown = orjson.dumps({"model": "gpt-4o-mini", "messages": [
                    *msgs, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": f"and then {r}? /src/x{r}.py"}]})
                t0 = time.process_time()
                decide(grown, orjson.loads(grown), rules, tok, history=cache, key=("t", "s"))
                samples[off]["session+1"].append(time.process_time() - t0)
        on = {k: statistics.median(v) * 1000 for k, v in samples[""].items()}
        line = f"  {n:>5} messages: all on cold {on['cold']:.2f} session+1 {on['session+1']:.2f}"
        for off in ("history", "prefilter"):
            m = {k: statistics.median(v) * 1000 for k, v in samples[off].items()}
            line += (f" | {off} off cold {m['cold'] / on['cold']:.2f}x"
                     f" session+1 {m['session+1'] / on['session+1']:.2f}x")
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--skip-http", action="store_true")
    args = ap.parse_args()
    plan_bench(args.rounds)
    if not args.skip_http:
        http_bench(args.rounds, args.seconds)


if __name__ == "__main__":
    main()

