"""What reading the provider's usage costs per request (not a test).

    PYTHONPATH=. python -m tests.perf.bench_usage [--requests 200] [--rounds 5]

1. The reader alone: each wire's answer from the built-in mock (JSON, and SSE as the
   mock streams it, one event per chunk), plus a 1 MiB JSON and a Responses stream
   whose response.completed is 1 MiB, fed to `UsageReader` as relayed; the minimum
   over repeats, in microseconds per answer.
2. End to end, in one process: the gateway (eviction off) in front of the mock,
   `--requests` x `--rounds` sequential requests each with usage reading on and off,
   in turns request by request (off: the relay is given no wire to read for, as a
   passthrough route is); the medians' difference of the event loop thread's CPU time
   (client, gateway and mock share it) is the cost, against the same run's baseline;
   on a loaded machine still noisy: the reader's own time above is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from aiohttp.test_utils import TestServer

from gateway.cli.mock_upstream import create_mock_app
from gateway.config.rules import load_rules
from gateway.observe import logging as mglog
from gateway.observe.usage import UsageReader
from gateway.proxy import chat_route
from gateway.proxy.app import create_app

ROOT = Path(__file__).resolve().parents[2]
MSGS = [{"role": "system", "content": "You are terse."},
        *[{"role": r, "content": f"message {i} " + "word " * 60}
          for i, r in zip(range(20), ["user", "assistant"] * 10, strict=True)],
        {"role": "user", "content": "And now?"}]
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat json": ("/v1/chat/completions", "openai_chat",
                  {"model": "gpt-4o-mini", "messages": MSGS}),
    "chat sse": ("/v1/chat/completions", "openai_chat",
                 {"model": "gpt-4o-mini", "messages": MSGS, "stream": True,
                  "stream_options": {"include_usage": True}}),
    "responses sse": ("/v1/responses", "openai_responses",
                      {"model": "gpt-4.1-mini", "input": MSGS[1:], "stream": True}),
    "anthropic sse": ("/v1/messages", "anthropic_messages",
                      {"model": "claude-3-5-haiku-20241022", "max_tokens": 100,
                       "messages": MSGS[1:], "stream": True}),
}


def fastest_feed(wire: str, sse: bool, chunks: list[bytes], repeat: int = 200) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = UsageReader(wire, sse)
        for c in chunks:
            r.feed(c)
        got = r.result()
        best = min(best, time.perf_counter() - t0)
    assert got, (wire, sse)
    return best * 1e6


async def record(base: str) -> dict[str, list[bytes]]:
    """Each case's answer from the mock, as the chunks the relay would see."""
    out = {}
    async with aiohttp.ClientSession() as s:
        for name, (path, _, body) in CASES.items():
            async with s.post(base + path, json=body) as r:
                out[name] = [c async for c in r.content.iter_any()]
    return out


def big_answers() -> dict[str, tuple[str, bool, list[bytes]]]:
    text = "x" * (1 << 20)
    raw = orjson.dumps({"id": "c", "choices": [{"message": {"content": text}}],
                        "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
    ev = (b"event: response.completed\ndata: " + orjson.dumps(
        {"type": "response.completed", "response": {
            "output": [{"content": [{"text": text}]}],
            "usage": {"input_tokens": 9, "output_tokens": 2}}}) + b"\n\n")
    split = [raw[i:i + 65536] for i in range(0, len(raw), 65536)]
    return {"chat json 1 MiB": ("openai_chat", False, split),
            "responses 1 MiB event": ("openai_responses", True,
                                      [ev[i:i + 65536] for i in range(0, len(ev), 65536)])}


async def end_to_end(requests: int, rounds: int) -> None:
    mglog.configure("json", "warning")  # no [mem] lines printed: they cost the same on/off
    mock = TestServer(create_mock_app())
    await mock.start_server()
    base = str(mock.make_url("")).rstrip("/")
    recorded = await record(base)
    print(f"{'answer':24} {'chunks':>6} {'bytes':>9} {'read us':>8}")
    for name, (_, wire, body) in CASES.items():
        sse = bool(body.get("stream"))
        # as the mock writes them: one event per chunk
        chunks = [e + b"\n\n" for e in b"".join(recorded[name]).split(b"\n\n") if e] \
            if sse else recorded[name]
        print(f"{name:24} {len(chunks):>6} {sum(map(len, chunks)):>9} "
              f"{fastest_feed(wire, sse, chunks):>8.1f}")
    for name, (wire, sse, chunks) in big_answers().items():
        print(f"{name:24} {len(chunks):>6} {sum(map(len, chunks)):>9} "
              f"{fastest_feed(wire, sse, chunks, 20):>8.1f}")

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "gateway.yaml"
        cfg.write_text(yaml.safe_dump({"memory": {"enable_eviction": False, "shadow": True},
                                       "tokens": {"models_file": str(ROOT / "rules"
                                                                     / "models.yaml")}}))
        env = {"MEMGATE_UPSTREAM": base, "MEMGATE_ANTHROPIC_UPSTREAM": base}
        gw = TestServer(create_app(load_rules(cfg, env), cfg, env))
        await gw.start_server()
        url = str(gw.make_url("")).rstrip("/")
        original = chat_route.relay

        async def unread(*a: Any, **kw: Any) -> Any:  # the relay as before usage reading
            kw["usage_wire"] = ""
            return await original(*a, **kw)

        print(f"\n{'through the gateway':24} {'off us':>8} {'on us':>8} {'cost us':>8} "
              f"{'cost %':>7}   (median CPU per request)")
        async with aiohttp.ClientSession() as s:
            for name, (path, _, body) in CASES.items():
                raw = orjson.dumps(body)
                took: dict[str, list[float]] = {"off": [], "on": []}
                for n in range(requests * rounds * 2):  # on and off in turns, per request
                    mode = "off" if n % 2 else "on"
                    chat_route.relay = unread if mode == "off" else original  # type: ignore[assignment]
                    t0 = time.thread_time()
                    async with s.post(url + path, data=raw, headers={
                            "Content-Type": "application/json",
                            "Authorization": "Bearer sk-bench"}) as r:
                        await r.read()
                    took[mode].append(time.thread_time() - t0)
                chat_route.relay = original  # type: ignore[assignment]
                off, on = (statistics.median(took[m]) * 1e6 for m in ("off", "on"))
                print(f"{name:24} {off:>8.0f} {on:>8.0f} {on - off:>8.0f} "
                      f"{(on - off) / off:>7.1%}")
        await gw.close()
    await mock.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(end_to_end(args.requests, args.rounds))


if __name__ == "__main__":
    main()
