#!/usr/bin/env python3
"""memgate's resident memory per 1,000 tracked sessions and per MB of history cache
(issue #22: "RSS per 1,000 tracked sessions and per MB of history cache, measured").

    python tests/perf/bench_memory.py [--sessions 5000] [--msgs 60]

Starts a fixed-answer upstream and memgate (eviction on, the shipped config) once per
run, drives N sessions (X-Session-Id, one request each, with a tenant key) in steps and
reads VmRSS (/proc/<pid>/status) and the history cache's own estimate
(`memgate_history_cache_bytes` on /metrics) after every step; the slope is reported:
  1.  `session.history_cache_mb: 0`, every session the same `--msgs`-message history
      (over the budget, so it is cut): what the tracked-session state alone (last cut,
      token sums, carry snapshot) costs;
  1b. the same with a history of its own per session: plus the token-count cache entries
      of new content (bounded by `tokens.cache_size`);
  2a/2. `--msgs`-message histories of their own, cache off / on (large enough that
      nothing is evicted): RSS of 2 minus RSS of 2a at the same step, against the cache's
      estimate = RSS per MB of history cache.
RSS is a noisy measure (allocator arenas, the garbage collector): each step sends
thousands of requests so the slope is well above that noise. Loopback only, bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import ROOT, UPSTREAM, Proc, body, free_port, history  # noqa: E402


def vmrss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    assert m, text
    return int(m.group(1)) / 1024


def shipped_config(root: Path = ROOT) -> dict[str, Any]:
    """rules/gateway.yaml of the tree at `root`, the files it names by absolute path (so a
    copy written elsewhere loads the same)."""
    data: dict[str, Any] = yaml.safe_load((root / "rules" / "gateway.yaml").read_text())
    carry = data["memory"].get("carry")
    if isinstance(carry, dict) and "rules_file" in carry:
        carry["rules_file"] = str(root / "rules" / carry["rules_file"])
    tokens = data.setdefault("tokens", {})
    if "models_file" in tokens:
        tokens["models_file"] = str(root / "rules" / tokens["models_file"])
    return data


def config(where: Path, cache_mb: int, tracked: int) -> Path:
    data = shipped_config()
    data["memory"]["enable_eviction"] = True
    data["session"] = {**data.get("session", {}), "history_cache_mb": cache_mb,
                       "max_tracked": tracked}
    path = where / f"mem-{cache_mb}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def drive(url: str, first: int, n: int, msgs: int, distinct: bool,
                conc: int = 8) -> None:
    """Sessions first..first+n-1, one request each: the same history under another
    X-Session-Id, or (distinct) a history of its own (new token-count cache entries)."""
    nxt = first
    same = body(history(msgs))

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal nxt
        while nxt < first + n:
            k, nxt = nxt, nxt + 1
            data = body(history(msgs, seed=k)) if distinct else same
            async with s.post(url, data=data, headers={
                    "X-Session-Id": f"s{k}", "Content-Type": "application/json",
                    "Authorization": "Bearer sk-bench"}) as r:  # a tenant: cached
                await r.read()
                assert r.status == 200, (r.status, await r.text())

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(worker(s) for _ in range(conc)))


async def cache_bytes(base: str) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/metrics") as r:
            text = await r.text()
    m = re.search(r"^memgate_history_cache_bytes\S*\s+([0-9.e+]+)", text, re.M)
    return float(m.group(1)) if m else float("nan")


def series(py: str, upstream: str, cfg: Path, steps: int, per_step: int, msgs: int,
           distinct: bool, log: Path) -> list[tuple[int, float, float]]:
    """[(sessions, VmRSS MB, history cache MB)] after each step."""
    port = free_port()
    mg = Proc([py, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(port),
               "--upstream", upstream], port, log=log)
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/chat/completions"
    try:
        asyncio.run(drive(url, 10**6, 200, msgs, distinct))  # warm-up: imports, caches, pools
        out = [(0, vmrss_mb(mg.p.pid), asyncio.run(cache_bytes(base)) / 2**20)]
        for k in range(steps):
            asyncio.run(drive(url, k * per_step, per_step, msgs, distinct))
            out.append(((k + 1) * per_step, vmrss_mb(mg.p.pid),
                        asyncio.run(cache_bytes(base)) / 2**20))
        return out
    finally:
        mg.stop()


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--msgs", type=int, default=60, help="history messages, run 2")
    a = ap.parse_args()
    py = sys.executable
    port = free_port()
    up = Proc([py, "-c", UPSTREAM, str(port)], port)
    upstream = f"http://127.0.0.1:{port}"
    tmp = tempfile.TemporaryDirectory(prefix="memgate-mem-")
    where = Path(tmp.name)
    per = a.sessions // a.steps
    try:
        tracked = a.sessions * 2 + 1000

        def show(title: str, rows: list[tuple[int, float, float]]) -> None:
            print(title)
            for n, rss, c in rows:
                print(f"  sessions {n:>6}  VmRSS {rss:8.1f} MB  history cache {c:6.1f} MB")

        s1 = series(py, upstream, config(where, 0, tracked), a.steps, per, a.msgs, False,
                    where / "run1.log")
        show(f"run 1: history cache off, every session the same {a.msgs}-message history "
             "(cut: the session's cut and carry snapshot are kept)", s1)
        per_k = slope([n for n, _, _ in s1], [r for _, r, _ in s1]) * 1000
        print(f"  => RSS per 1,000 tracked sessions: {per_k:.2f} MB")
        s1b = series(py, upstream, config(where, 0, tracked), a.steps, per, 10, True,
                     where / "run1b.log")
        show("run 1b: history cache off, a 10-message history of its own per session", s1b)
        per_kb = slope([n for n, _, _ in s1b], [r for _, r, _ in s1b]) * 1000
        print(f"  => RSS per 1,000 sessions with new content: {per_kb:.2f} MB (the token-count"
              f" cache, bounded by tokens.cache_size, holds the difference)")
        s2b = series(py, upstream, config(where, 0, tracked), a.steps, per, a.msgs, True,
                     where / "run2b.log")
        show(f"run 2a: history cache off, a {a.msgs}-message history of its own per session",
             s2b)
        s2 = series(py, upstream, config(where, 4096, tracked), a.steps, per, a.msgs, True,
                    where / "run2.log")
        show(f"run 2: history cache on, a {a.msgs}-message history of its own per session "
             f"(~{len(body(history(a.msgs))) / 1024:.0f} KB body)", s2)
        # the same sessions without the cache (run 2a) taken off, step by step
        ys = [r - r0 for (_, r, _), (_, r0, _) in zip(s2, s2b)]
        per_mb = slope([c for _, _, c in s2], ys)
        print(f"  => RSS per MB of history cache (its own estimate; run 2a's RSS at the same "
              f"step taken off): {per_mb:.2f} MB")
        print(f"  => history cache per session of {a.msgs} messages: "
              f"{(s2[-1][2] - s2[0][2]) / (s2[-1][0] - s2[0][0]) * 1024:.1f} KB")
    finally:
        up.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
