#!/usr/bin/env python3
"""Resident memory per tracked session: N distinct X-Session-Id values, one short chat
each (issue #39: "Memory per tracked session is large").

    python tests/perf/bench_sessions.py [--sessions 2000,5000,10000] [--evict]

For each N: starts a fixed-answer upstream and `memgate serve` (the shipped config,
rules/gateway.yaml; `--evict` turns eviction on), sends 200 warm-up chats, reads VmRSS
(/proc/PID/status), sends N short chats (a system prompt, a question, an answer and a
follow-up, with text of its own per session, a Bearer key: a tenant, whose sessions are
remembered), reads VmRSS again and reports (after - before) / N in KB. A fresh server
per N, so each figure is the growth from the same start. Loopback only, bounded.

    python tests/perf/bench_sessions.py --heap 5000 [--evict]

instead drives `create_app` in this process (an aiohttp test server, the upstream in the
same loop) under tracemalloc and prints what the N sessions left allocated: by the line
that allocated it, and by the structure holding it (the session state stores, the
history cache, the token and carry caches), in bytes per session.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import REPLY, ROOT, UPSTREAM, Proc, free_port  # noqa: E402
from bench_memory import shipped_config, vmrss_mb  # noqa: E402

PAD = [0]  # --pad-kb: text of its own per session in the answer (content, not bookkeeping)


def short_chat(k: int) -> bytes:
    pad = "".join(f" fact{k}x{i}" for i in range(PAD[0] * 1024 // 12))[: PAD[0] * 1024]
    return orjson.dumps({"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"What is the capital of country number {k}?"},
        {"role": "assistant", "content": f"Country {k} has its capital at city {k * 7}.{pad}"},
        {"role": "user", "content": f"And its population, roughly? ({k})"}]})


def config(where: Path, evict: bool, tracked: int | None, cache_mb: int | None = None,
           root: Path = ROOT) -> Path:
    """The shipped config of the tree at `root`, with these settings."""
    data = shipped_config(root)
    data["memory"]["enable_eviction"] = evict
    if tracked is not None:
        data["session"] = {**data.get("session", {}), "max_tracked": tracked}
    if cache_mb is not None:
        data["limits"] = {**data.get("limits", {}), "cache_mb": cache_mb}
    path = where / "sessions.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def drive(url: str, first: int, n: int, conc: int = 8) -> None:
    nxt = first

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal nxt
        while nxt < first + n:
            k, nxt = nxt, nxt + 1
            async with s.post(url, data=short_chat(k), headers={
                    "X-Session-Id": f"sess-{k}", "Content-Type": "application/json",
                    "Authorization": "Bearer sk-bench"}) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(worker(s) for _ in range(conc)))


def run(memgate: list[str], upstream: str, cfg: Path, n: int, tree: Path | None = None
        ) -> tuple[float, float]:
    """(VmRSS MB before, after) N sessions on a fresh server."""
    port = free_port()
    mg = Proc([*memgate, "serve", "--config", str(cfg), "--port", str(port),
               "--upstream", upstream], port, cwd=tree,
              env={"PYTHONPATH": str(tree)} if tree is not None else None)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        asyncio.run(drive(url, 10**7, 200))  # warm-up: imports, pools, first allocations
        before = vmrss_mb(mg.p.pid)
        asyncio.run(drive(url, 0, n))
        return before, vmrss_mb(mg.p.pid)
    finally:
        mg.stop()


def deep_size(obj: Any) -> int:
    """Bytes an object holds with everything it refers to (modules, classes and functions
    not followed: what they hold is not the structure's)."""
    import gc
    import types
    seen: set[int] = set()
    total, todo = 0, [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType,
                                           types.BuiltinFunctionType, types.MethodType)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        todo.extend(gc.get_referents(o))
    return total


async def heap(n: int, evict: bool) -> None:
    import functools
    import gc
    import tracemalloc

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from gateway.config.rules import load_rules
    from gateway.proxy.app import create_app
    from gateway.proxy.appstate import STATE

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=REPLY, content_type="application/json")

    up_app = web.Application()
    up_app.router.add_post("/{t:.*}", answer)
    up = TestServer(up_app)
    await up.start_server()
    env = {"MEMGATE_UPSTREAM": str(up.make_url("")).rstrip("/")}
    with tempfile.TemporaryDirectory(prefix="memgate-heap-") as tmp:
        rules = load_rules(config(Path(tmp), evict, None), env)
    app = create_app(rules, env=env)
    srv = TestServer(app)
    await srv.start_server()
    url = str(srv.make_url("/v1/chat/completions"))
    await drive(url, 10**7, 200)
    state = app[STATE]
    parts: dict[str, Any] = {
        "session state: last cuts": getattr(state.sessions, "records", None),
        "session state: carry snapshots": getattr(state.sessions, "snapshots", None),
        "session state: Responses answer ids": getattr(state.sessions, "responses", None),
        "history cache (items, head parse, tokens, fold, splice records)": state.history,
        "sessions in fallback backoff": state.refused,
        "console": state.console,
        "token-count caches": state.tokenizers,
        "metrics": state.metrics,
    }
    held0 = {name: deep_size(obj) for name, obj in parts.items() if obj is not None}
    gc.collect()
    tracemalloc.start(1)
    snap0 = tracemalloc.take_snapshot()
    await drive(url, 0, n)
    gc.collect()
    snap1 = tracemalloc.take_snapshot()
    print(f"traced growth over {n} sessions, top allocation sites (bytes/session):")
    stats = snap1.compare_to(snap0, "lineno")
    total = sum(s.size_diff for s in stats)
    for s in stats[:25]:
        print(f"  {s.size_diff / n:8.0f}  {s.traceback}")
    print(f"  {total / n:8.0f}  in all")
    tracemalloc.stop()
    print("growth held by each structure (bytes/session; what two share is in both):")
    for name, before in held0.items():
        print(f"  {(deep_size(parts[name]) - before) / n:8.0f}  {name}")
    from gateway.policy import fill
    from gateway.policy.carry import calls, snapshot
    for name, memo in (("carry extraction", snapshot.EXTRACTED), ("fill words", fill.COUNTED),
                       ("carry call facts", calls.FACTS)):
        print(f"  {memo.bytes / n:8.0f}  {name} (its own estimate, {len(memo)} entries)")
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if not name.startswith("gateway."):
            continue
        for attr, val in list(vars(mod).items()):
            if isinstance(val, functools._lru_cache_wrapper):
                info = val.cache_info()
                if info.currsize:
                    print(f"  {'':8}  lru {name}.{attr}: {info.currsize} entries "
                          f"(max {info.maxsize})")
    await srv.close()
    await up.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="2000,5000,10000")
    ap.add_argument("--evict", action="store_true", help="memory.enable_eviction: true")
    ap.add_argument("--tracked", type=int, default=None, help="session.max_tracked")
    ap.add_argument("--cache-mb", type=int, default=None, help="limits.cache_mb")
    ap.add_argument("--pad-kb", type=int, default=0,
                    help="KB of text of its own per session (fills the content caches)")
    ap.add_argument("--tree", type=Path, default=None,
                    help="serve another source tree (python -m gateway from there), e.g. "
                    "an unpacked `git archive` of an older commit")
    ap.add_argument("--heap", type=int, default=0, help="in-process tracemalloc, N sessions")
    ap.add_argument("--memgate", default=shutil.which("memgate") or
                    str(Path(sys.executable).parent / "memgate"))
    a = ap.parse_args()
    PAD[0] = a.pad_kb
    if a.heap:
        asyncio.run(heap(a.heap, a.evict))
        return
    port = free_port()
    up = Proc([sys.executable, "-c", UPSTREAM, str(port)], port)
    tmp = tempfile.TemporaryDirectory(prefix="memgate-sessions-")
    try:
        cfg = config(Path(tmp.name), a.evict, a.tracked, a.cache_mb, a.tree or ROOT)
        memgate = [sys.executable, "-m", "gateway"] if a.tree else [a.memgate]
        print(f"eviction {'on' if a.evict else 'off (shipped)'}, "
              f"chat {len(short_chat(0))} bytes")
        for n in (int(x) for x in a.sessions.split(",")):
            before, after = run(memgate, f"http://127.0.0.1:{port}", cfg, n, a.tree)
            print(f"  N={n:>6}  VmRSS {before:7.1f} -> {after:7.1f} MB  "
                  f"{(after - before) * 1024 / n:6.1f} KB/session", flush=True)
    finally:
        up.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
