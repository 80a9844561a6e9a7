#!/usr/bin/env python3
"""What OpenTelemetry tracing costs: memgate with tracing off vs on, same run (loopback only).

    python tests/perf/bench_tracing.py [--seconds 2] [--rounds 3]

Starts the fixed-answer upstream of bench_gateway.py, a local OTLP/HTTP collector (answers
POST /v1/traces and /v1/metrics, counts what arrives) and four gateways: eviction off and
on, each with tracing off and with `tracing.enabled: true` exporting spans (batched) and
GenAI metrics (every second) to the collector. Per payload size it prints p50 latency at
concurrency 1, throughput at concurrency 16 and the gateway's CPU time per request under
that load (medians of alternating rounds), and the traced/untraced ratios of each; then
the CPU per traced request measured in-process, and what the collector received.
Bounded in time; everything stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway as bg

COLLECTOR = """
import sys
from aiohttp import web
seen = {"/v1/traces": [0, 0], "/v1/metrics": [0, 0]}
async def collect(r):
    body = await r.read()
    seen[r.path][0] += 1
    seen[r.path][1] += len(body)
    return web.Response(body=b"", content_type="application/x-protobuf")
async def stats(r):
    return web.json_response(seen)
app = web.Application(client_max_size=1 << 30)
app.router.add_post("/v1/traces", collect)
app.router.add_post("/v1/metrics", collect)
app.router.add_get("/stats", stats)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""
SIZES = {"small": 10, "medium": 60, "large": 300}


def config(path: Path, traced: bool) -> Path:
    """rules/gateway.yaml with its files made absolute and tracing on or off."""
    data = yaml.safe_load((bg.ROOT / "rules" / "gateway.yaml").read_text(encoding="utf-8"))
    data.setdefault("tokens", {})["models_file"] = str(bg.ROOT / "rules" / "models.yaml")
    carry = data.get("memory", {}).get("carry")
    if isinstance(carry, dict):
        carry["rules_file"] = str(bg.ROOT / "rules" / carry.get("rules_file", "carry.yaml"))
    data["tracing"] = {"enabled": traced}
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


async def collector_stats(port: int) -> dict[str, list[int]]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/stats") as r:
        got: dict[str, list[int]] = await r.json()
        return got


def per_span(port: int, n: int = 20_000) -> None:
    """CPU per traced request in this process (all threads: the batch exporter's too):
    start, upstream headers, [mem] fields, end, metrics; OTLP to the collector."""
    import time

    from aiohttp.test_utils import make_mocked_request
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from gateway.config.schema import Upstream
    from gateway.observe.otel import Tracing
    from gateway.observe.relayed import Relayed
    from gateway.wire.openai_chat import OPENAI_CHAT

    base = f"http://127.0.0.1:{port}"
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
    mp = MeterProvider(metric_readers=[PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=f"{base}/v1/metrics"), 1000)])
    tracing = Tracing(tp, mp)
    up = Upstream("openai", "http://127.0.0.1:1")
    fields = {"session": "s-1", "turn": 12, "hist_msgs": 60, "hist_chars": 20000,
              "est_tokens": 6500, "budget_tokens": 6000, "evict": "length", "kept": 40,
              "dropped": 20, "pinned": 1, "cut": "kept", "prefix_tokens": 5000, "mode": "on",
              "model": "gpt-4o-mini", "status": 200, "upstream_ms": 3.2, "overhead_ms": 1.1,
              "req": "5ad362e475c04017"}
    req = make_mocked_request("POST", "/v1/chat/completions", headers={
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})

    async def nothing() -> None:
        return None

    async def run() -> float:
        c0 = time.process_time()
        for k in range(n):
            info = Relayed(status=200)
            span = tracing.start(req, info, OPENAI_CHAT)
            span.upstream(req, up)
            tracing.observe(fields, None, info)
            await span.after(nothing())
            if k % 1000 == 999:  # a tight loop outruns the exporter's bounded queue
                tp.force_flush()
        return (time.process_time() - c0) / n * 1e6

    async def baseline() -> float:  # the same loop without tracing
        c0 = time.process_time()
        for _ in range(n):
            Relayed(status=200)
            await nothing()
        return (time.process_time() - c0) / n * 1e6

    with_span, without = asyncio.run(run()), asyncio.run(baseline())
    tp.shutdown()
    mp.shutdown()
    print(f"\nin-process: {with_span - without:.1f} us CPU per traced request "
          f"(span + attributes + propagation + metrics + batched OTLP export, {n} requests)")


def measure(proc: bg.Proc, payload: bytes, seconds: float) -> tuple[float, float, float]:
    """(p50 ms at concurrency 1, req/s at 16, the gateway's CPU ms per request under it)."""
    url = f"http://127.0.0.1:{proc.port}/v1/chat/completions"
    asyncio.run(bg.latency(url, payload, 0.3))  # warm-up
    lat = asyncio.run(bg.latency(url, payload, seconds))
    c0 = proc.cpu_s()
    rps = asyncio.run(bg.throughput(url, payload, seconds))
    return lat, rps, (proc.cpu_s() - c0) / max(1.0, rps * seconds) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs; medians shown")
    args = ap.parse_args()
    py = sys.executable
    up = bg.Proc([py, "-c", bg.UPSTREAM, str(port := bg.free_port())], port)
    col = bg.Proc([py, "-c", COLLECTOR, str(cport := bg.free_port())], cport)
    procs = [up, col]
    tmp = tempfile.TemporaryDirectory(prefix="memgate-bench-otel-")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{cport}",
           "OTEL_METRIC_EXPORT_INTERVAL": "1000", "MEMGATE_LOG_FORMAT": "json"}
    try:
        targets: dict[str, bg.Proc] = {}
        for mode, evict in (("off", "0"), ("on", "1")):
            for traced in (False, True):
                name = f"{mode}{'+otel' if traced else ''}"
                cfg = config(Path(tmp.name) / f"{name}.yaml", traced)
                p = bg.free_port()
                targets[name] = bg.Proc(
                    [py, "-m", "gateway", "serve", "--config", str(cfg), "--port", str(p),
                     "--upstream", f"http://127.0.0.1:{up.port}"], p,
                    {**env, "MEMGATE_ENABLE_EVICTION": evict})
                procs.append(targets[name])
        print(f"{'payload':<7} {'mode':<4} | {'p50 ms':>7} {'otel':>7} {'ratio':>6} | "
              f"{'rps':>6} {'otel':>6} {'ratio':>6} | {'cpu ms':>6} {'otel':>6} {'ratio':>6}"
              f" {'+ms':>6}")
        for size, n in SIZES.items():
            payload = bg.body(bg.history(n))
            for mode in ("off", "on"):
                runs: dict[str, list[tuple[float, float, float]]] = {mode: [],
                                                                      f"{mode}+otel": []}
                for _ in range(args.rounds):  # pairs back to back, alternating: same drift
                    for name, got in runs.items():
                        got.append(measure(targets[name], payload, args.seconds))
                (l0, r0, c0_), (l1, r1, c1) = (
                    tuple(statistics.median(x[i] for x in got) for i in range(3))
                    for got in runs.values())
                print(f"{size:<7} {mode:<4} | {l0:>7.3f} {l1:>7.3f} {l1 / l0:>6.2f} | "
                      f"{r0:>6.0f} {r1:>6.0f} {r1 / r0:>6.2f} | {c0_:>6.3f} {c1:>6.3f} "
                      f"{c1 / c0_:>6.2f} {c1 - c0_:>+6.3f}")
        per_span(cport)
        for name in ("off+otel", "on+otel"):  # flush: the batch processor exports on stop
            targets[name].stop()
            procs.remove(targets[name])
        seen = asyncio.run(collector_stats(cport))
        print(f"\ncollector: {seen['/v1/traces'][0]} trace exports "
              f"({seen['/v1/traces'][1]} bytes), {seen['/v1/metrics'][0]} metric exports")
    finally:
        for p in procs:
            p.stop()
        tmp.cleanup()


if __name__ == "__main__":
    main()
