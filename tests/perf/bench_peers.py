#!/usr/bin/env python3
"""What a user pays: memgate (eviction on, 1 and 2 workers; `memgate-nokey`: as the
harness's placeholder key is served, see memgate_config) side by side with the peers a
user would pick instead (LiteLLM proxy, Headroom proxy), same payloads, same nginx mock
upstream, one run, as ratios/differences against `direct` and `aiohttp-passthrough`
measured in the same run (issue #22 item 2).

    bash ../shared/bench/setup.sh     # nginx, wrk, /tmp/bench-venv, /tmp/litellm-venv
    python3.11 -m venv /tmp/headroom-venv && /tmp/headroom-venv/bin/pip install 'headroom-ai[proxy]'
    python tests/perf/bench_peers.py [--rounds 2] [--duration 4] [--warmup 1]
    MEMGATE_BIN=... MEMGATE_BASELINE_BIN=... python tests/perf/bench_peers.py \
        --targets direct,aiohttp-passthrough,memgate,memgate-base,litellm,headroom
    python tests/perf/bench_peers.py --targets \
        direct,aiohttp-passthrough,memgate,memgate-nofill,memgate-off,litellm

It drives the shared harness (`../shared/bench/run.py`, imported, not copied or edited)
with `--custom` targets and records, around each of the harness's wrk runs, which target,
payload and concurrency was running when, so memgate's own `overhead_ms` (time from the
request body having arrived to the request leaving, from its JSON `[mem]` lines in the
harness's per-target log) is split per payload and per load level. Each round runs every
target; `--rounds` repeats the whole comparison (the machine is shared: the load average
is recorded per target) and the report gives every round and the median of the rounds.
Bounded in time (the harness's --max-minutes per round); every process is stopped by pid.
The opt-in targets `memgate-nofill` (the budget-filling recall off) and `memgate-off`
(eviction off) say, in the same run, what the fill costs a cut request and what the
measuring alone (every request's [mem] line, eviction or not) costs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# ../shared/bench beside the checkout (or beside its parent, for a worktree inside one)
BENCH = Path(os.environ.get("MEMGATE_BENCH_DIR") or next(
    (p for p in (ROOT.parent / "shared" / "bench", ROOT.parent.parent / "shared" / "bench")
     if (p / "run.py").exists()), ROOT.parent / "shared" / "bench"))
MEMGATE = os.environ.get("MEMGATE_BIN", "/work/main/.venv/bin/memgate")
# another build of memgate measured beside it as `memgate-base` (e.g. the main branch's
# while MEMGATE_BIN runs a branch's), when set
BASELINE = os.environ.get("MEMGATE_BASELINE_BIN", "")
HEADROOM = os.environ.get("HEADROOM_BIN", "/tmp/headroom-venv/bin/headroom")
PAYLOADS = "small,medium,large,huge,anthropic-medium"
TARGETS = "direct,aiohttp-passthrough,memgate,memgate-w2,memgate-nokey,litellm,headroom"
# the #22 targets for memgate's own overhead_ms (p50 by payload; p99 <= 1 ms except 1 MB)
OVERHEAD_P50 = {"small": 0.1, "medium": 0.2, "large": 0.2, "anthropic-medium": 0.2, "huge": 0.5}
OVERHEAD_P99 = 1.0


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    assert spec is not None and spec.loader is not None, BENCH
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# opt-in memgate targets (not in TARGETS; name them in --targets): the keyed config with
# one thing changed, so that one run says what that thing costs a user beside the rest
VARIANTS = {
    # the budget-filling recall off (memory.eviction.recall_share: 0): what the fill costs
    # a cut request
    "memgate-nofill": "nofill",
    # eviction and shadow off: every request is still measured, recorded and logged (the
    # [mem] line), forwarded before it is measured; the floor of the eviction-on figures
    "memgate-off": "off",
    # memory.retrieve off (shipped on): beside `memgate`, what the retrieval tool costs a
    # request that needs no retrieval (the mock upstream never calls it)
    "memgate-noretrieve": "noretrieve",
}


def memgate_config(where: Path, tenant: str | None = "bench", variant: str = "") -> Path:
    """The shipped rules/gateway.yaml with eviction on and JSON logs (its budget of 6,000
    tokens cuts the large, 1 MB and anthropic-medium payloads; small and medium fit
    whole) and, with `tenant`, that tenant for callers without a usable key. `variant`:
    one of VARIANTS' values, applied to that.

    The harness sends `Authorization: Bearer sk-fake`, a placeholder memgate takes for no
    key (shared by every client whose key is unset): such a caller has no tenant, so no
    session state and no history cache, and every request is parsed, counted and planned
    cold. A deployment's callers send their own keys; `tenants.anonymous` serves the
    harness's requests as one keyed caller's (one tenant, its sessions cached), which is
    what they then pay. `tenant=None` keeps the shipped `anonymous: null` (memgate-nokey:
    what callers without a key pay)."""
    import yaml

    src = Path(os.environ.get("MEMGATE_RULES", "/work/main/rules/gateway.yaml"))
    data = yaml.safe_load(src.read_text(encoding="utf-8"))
    data["memory"]["enable_eviction"] = True
    carry = data["memory"].get("carry")
    if isinstance(carry, dict) and "rules_file" in carry:
        carry["rules_file"] = str(src.parent / carry["rules_file"])
    tokens = data.setdefault("tokens", {})
    if "models_file" in tokens:
        tokens["models_file"] = str(src.parent / tokens["models_file"])
    data["logging"] = {"format": "json", "level": "info"}
    data.setdefault("tenants", {})["anonymous"] = tenant
    if variant == "nofill":
        data["memory"]["eviction"]["recall_share"] = 0.0
    elif variant == "noretrieve":
        data["memory"].setdefault("retrieve", {})["enabled"] = False
    elif variant == "off":
        data["memory"]["enable_eviction"] = False
        data["memory"]["shadow"] = False
    elif variant:
        raise ValueError(f"unknown variant {variant!r}")
    path = where / ("memgate-evict" + ("" if tenant else "-nokey")
                    + (f"-{variant}" if variant else "") + ".yaml")
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def custom_targets(cfg: Path, nokey: Path, variants: dict[str, Path] | None = None
                   ) -> dict[str, str]:
    """{name: command template} for the harness's --custom ({port}, {upstream});
    `variants`: {target name: its config} (VARIANTS)."""
    def serve(config: Path, memgate: str = MEMGATE) -> str:
        return (f"MEMGATE_LOG_FORMAT=json exec {memgate} serve --config {config} "
                f"--port {{port}} --upstream {{upstream}} --anthropic-upstream {{upstream}}")

    mg = serve(cfg)
    # Headroom in its default optimizing mode (cache mode: structural compressors, CCR)
    # minus what needs a model download or a network: Kompress (ML compression), the
    # semantic cache; rate limiting (60 rpm by default) and telemetry off; its LiteLLM
    # import kept from fetching the cost map; egress to anything but loopback fails fast
    # tiktoken's o200k/cl100k files cannot be fetched offline: a load error is retried
    # (and fails optimisation) on every request, a load timeout is remembered and
    # Headroom falls back to its token estimate, so the timeout is made immediate
    hr = ("HEADROOM_TELEMETRY=off HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "
          "HEADROOM_TIKTOKEN_LOAD_TIMEOUT_SECONDS=0.001 "
          "LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_LOG=ERROR "
          "HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 "
          "NO_PROXY=127.0.0.1,localhost "
          f"exec {HEADROOM} proxy --host 127.0.0.1 --port {{port}} "
          "--openai-api-url {upstream} --anthropic-api-url {upstream} "
          + os.environ.get("HEADROOM_FLAGS", "--disable-kompress --no-cache --no-rate-limit "
                           "--no-telemetry --no-http2 --no-subscription-tracking"))
    base = {"memgate-base": serve(cfg, BASELINE)} if BASELINE else {}
    more = {name: serve(path) for name, path in (variants or {}).items()}
    return {"memgate": mg, "memgate-w2": mg + " --workers 2", "memgate-nokey": serve(nokey),
            **base, **more, "headroom": hr}


class Recorder:
    """Wraps the harness's start_target and run_wrk: which target/payload/concurrency ran
    when (wall clock, to split memgate's [mem] lines), and the load average per target."""

    def __init__(self, mod: Any) -> None:
        self.windows: list[dict[str, Any]] = []
        self.load: dict[str, list[float]] = {}
        self.target = ""
        # the harness's own functions, whatever an earlier round's Recorder put there
        start_target = mod.__dict__.setdefault("_orig_start_target", mod.start_target)
        run_wrk = mod.__dict__.setdefault("_orig_run_wrk", mod.run_wrk)

        def start(name: str, args: Any, upstream: str, phase: str, port: int) -> Any:
            self.target = name
            self.load.setdefault(name, []).append(os.getloadavg()[0])
            return start_target(name, args, upstream, phase, port)

        def wrk(args: Any, url: str, meta: dict[str, Any], conns: int, seconds: float) -> Any:
            t0 = time.time()
            try:
                return run_wrk(args, url, meta, conns, seconds)
            finally:
                self.windows.append({"target": self.target, "payload": Path(meta["file"]).stem,
                                     "conns": conns, "t0": t0, "t1": time.time()})

        mod.start_target, mod.run_wrk = start, wrk


def mem_lines(log: Path) -> list[tuple[float, float]]:
    """(unix time, overhead_ms) of every [mem] line of a memgate log."""
    out: list[tuple[float, float]] = []
    if not log.exists():
        return out
    for line in log.read_bytes().splitlines():
        if not line.startswith(b"{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "mem" and "overhead_ms" in ev:
            ts = dt.datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append((ts, float(ev["overhead_ms"])))
    return out


def q(vals: list[float], p: float) -> float | None:
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    return statistics.quantiles(vals, n=100, method="inclusive")[int(p) - 1]


def overheads(rec: Recorder, run_dir: Path, target: str) -> dict[str, dict[str, Any]]:
    """overhead_ms p50/p99 per payload at c=1 (the latency run) and at c=N (throughput);
    the first 0.2 s of each window is skipped (the previous run's last lines)."""
    lines = mem_lines(run_dir / f"{target}-json.log")
    res: dict[str, dict[str, Any]] = {}
    for w in rec.windows:
        if w["target"] != target or w["conns"] not in (1, 32):
            continue  # the warm-up (8 connections)
        vals = [o for ts, o in lines if w["t0"] + 0.2 <= ts <= w["t1"]]
        key = "c1" if w["conns"] == 1 else "cN"
        res.setdefault(w["payload"], {})[key] = {"n": len(vals), "p50": q(vals, 50),
                                                 "p99": q(vals, 99)}
    return res


def one_round(mod: ModuleType, k: int, a: argparse.Namespace, cfg: Path, nokey: Path,
              out: Path, variants: dict[str, Path]) -> dict[str, Any]:
    rec = Recorder(mod)
    run_dir, res_path = out / f"run{k}", out / f"round{k}.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    customs = custom_targets(cfg, nokey, variants)
    targets = [t for t in a.targets.split(",") if t]
    argv = ["run.py", "--targets", ",".join(targets), "--payloads", a.payloads,
            "--duration", str(a.duration), "--warmup", str(a.warmup),
            "--stream-requests", str(a.stream_requests), "--trickle-requests", "10",
            "--run-dir", str(run_dir), "--out", str(res_path),
            "--max-minutes", str(a.max_minutes)]
    for name, cmd in customs.items():
        if name in targets:
            argv += ["--custom", f"{name}={cmd}"]
    load0 = os.getloadavg()
    old = sys.argv
    sys.argv = argv
    try:
        rc = mod.main()
    finally:
        sys.argv = old
    result: dict[str, Any] = json.loads(res_path.read_text())
    result["rc"] = rc
    result["loadavg_start"] = load0
    result["loadavg_end"] = os.getloadavg()
    result["loadavg_per_target"] = rec.load
    result["windows"] = rec.windows
    result["overhead_ms"] = {t: overheads(rec, run_dir, t) for t in targets
                             if t.startswith("memgate")}
    res_path.write_text(json.dumps(result, indent=2, default=str))
    return result


def med(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return statistics.median(got) if got else None


def cell(rounds: list[dict[str, Any]], target: str, payload: str, key: str) -> list[float | None]:
    out = []
    for r in rounds:
        row = next((x for x in r["results"] if x["target"] == target and x["payload"] == payload
                    and x.get("status") == "ok"), None)
        out.append(row.get(key) if row else None)
    return out


def stream(rounds: list[dict[str, Any]], target: str, key: str) -> list[float | None]:
    return [next((s.get(key) for s in r["streaming"] if s["target"] == target), None)
            for r in rounds]


def f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def report(rounds: list[dict[str, Any]], targets: list[str], payloads: list[str]) -> str:
    """Median of the rounds for every figure; each round's value in [] where it matters."""
    L: list[str] = []
    for k, r in enumerate(rounds):
        L.append(f"round {k}: load average {r['loadavg_start'][0]:.2f} -> "
                 f"{r['loadavg_end'][0]:.2f}; per target at start "
                 + ", ".join(f"{t} {min(v):.2f}" for t, v in r["loadavg_per_target"].items())
                 + f"; harness rc={r['rc']}")
    L.append("")
    L.append(f"{'target':<20} {'payload':<17} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} "
             f"{'+p99 ms':>8} {'req/s':>7} {'rps/pt':>6} {'cpu us':>7} {'cpu/pt':>6}  rounds +p50")
    med_tab: dict[tuple[str, str], dict[str, Any]] = {}
    for t in targets:
        for p in payloads:
            d50, d99 = cell(rounds, "direct", p, "p50_ms"), cell(rounds, "direct", p, "p99_ms")
            p50, p99 = cell(rounds, t, p, "p50_ms"), cell(rounds, t, p, "p99_ms")
            rps, cpu = cell(rounds, t, p, "rps"), cell(rounds, t, p, "cpu_us_per_req")
            pt_rps = cell(rounds, "aiohttp-passthrough", p, "rps")
            pt_cpu = cell(rounds, "aiohttp-passthrough", p, "cpu_us_per_req")

            def diff(x: list[Any], y: list[Any]) -> list[float | None]:
                return [a - b if a is not None and b is not None else None for a, b in zip(x, y)]

            def ratio(x: list[Any], y: list[Any]) -> list[float | None]:
                return [a / b if a is not None and b else None for a, b in zip(x, y)]

            m: dict[str, Any] = {"p50": med(p50), "p99": med(p99), "add50": med(diff(p50, d50)),
                 "add99": med(diff(p99, d99)), "rps": med(rps), "rps_pt": med(ratio(rps, pt_rps)),
                 "cpu": med(cpu), "cpu_pt": med(ratio(cpu, pt_cpu))}
            med_tab[(t, p)] = m
            L.append(f"{t:<20} {p:<17} {f(m['p50'], '.3f'):>7} {f(m['p99'], '.3f'):>7} "
                     f"{f(m['add50'], '.3f'):>8} {f(m['add99'], '.3f'):>8} {f(m['rps'], '.0f'):>7} "
                     f"{f(m['rps_pt']):>6} {f(m['cpu'], '.0f'):>7} {f(m['cpu_pt']):>6}  "
                     + "/".join(f(v, ".3f") for v in diff(p50, d50)))
    L.append("")
    L.append("stream (medium-stream, sequential): TTFB p50/p99 ms, minus passthrough's p50; "
             "slow upstream TTFB/total")
    pt_ttfb = stream(rounds, "aiohttp-passthrough", "ttfb_p50_ms")
    for t in targets:
        tt = stream(rounds, t, "ttfb_p50_ms")
        dd = [a - b if a is not None and b is not None else None for a, b in zip(tt, pt_ttfb)]
        L.append(f"  {t:<20} ttfb p50 {f(med(tt), '.3f')} p99 "
                 f"{f(med(stream(rounds, t, 'ttfb_p99_ms')), '.3f')}  vs passthrough "
                 f"{f(med(dd), '+.3f')} [{'/'.join(f(v, '+.3f') for v in dd)}]  slow "
                 f"{f(med(stream(rounds, t, 'trickle_ttfb_p50_ms')))}/"
                 f"{f(med(stream(rounds, t, 'trickle_total_p50_ms')))}")
    L.append("")
    L.append("memgate overhead_ms from its own [mem] lines (c=1 latency run | c=32 "
             "throughput run): p50 / p99 (n)")
    verdicts: list[str] = []
    for t in [x for x in targets if x.startswith("memgate")]:
        for p in payloads:
            c1 = [r["overhead_ms"].get(t, {}).get(p, {}).get("c1", {}) for r in rounds]
            cn = [r["overhead_ms"].get(t, {}).get(p, {}).get("cN", {}) for r in rounds]
            o50, o99 = med([c.get("p50") for c in c1]), med([c.get("p99") for c in c1])
            L.append(f"  {t:<14} {p:<17} {f(o50, '.3f')} / {f(o99, '.3f')} "
                     f"({sum(c.get('n', 0) for c in c1)}) | "
                     f"{f(med([c.get('p50') for c in cn]), '.3f')} / "
                     f"{f(med([c.get('p99') for c in cn]), '.3f')} "
                     f"({sum(c.get('n', 0) for c in cn)})")
            if t == "memgate" and p in OVERHEAD_P50:
                verdicts.append(mark(f"overhead_ms p50 <= {OVERHEAD_P50[p]} ms ({p})", o50,
                                     o50 is not None and o50 <= OVERHEAD_P50[p]))
                if p != "huge":
                    verdicts.append(mark(f"overhead_ms p99 <= {OVERHEAD_P99} ms ({p})", o99,
                                         o99 is not None and o99 <= OVERHEAD_P99))
    mg_tt = stream(rounds, "memgate", "ttfb_p50_ms")
    dd = [a - b if a is not None and b is not None else None for a, b in zip(mg_tt, pt_ttfb)]
    d_tt = med(dd)
    verdicts.append(mark("stream TTFB <= passthrough + 0.2 ms", d_tt,
                         d_tt is not None and d_tt <= 0.2))
    c = med_tab.get(("memgate", "medium"), {}).get("cpu_pt")
    verdicts.append(mark("CPU/request, eviction on, <= 1.6x passthrough (medium)", c,
                         c is not None and c <= 1.6))
    for peer in ("litellm", "headroom"):
        if peer not in targets:
            continue
        for p in payloads:
            mg, pe = med_tab.get(("memgate", p), {}), med_tab.get((peer, p), {})
            la = pe.get("add50") / mg["add50"] if mg.get("add50") and pe.get("add50") else None
            ca = pe.get("cpu") / mg["cpu"] if mg.get("cpu") and pe.get("cpu") else None
            verdicts.append(mark(f">= 10x lower added p50 latency than {peer} ({p})", la,
                                 la is not None and la >= 10))
            verdicts.append(mark(f">= 5x lower CPU/request than {peer} ({p})", ca,
                                 ca is not None and ca >= 5))
    w1, w2 = med_tab.get(("memgate", "medium"), {}), med_tab.get(("memgate-w2", "medium"), {})
    if w1.get("rps") and w2.get("rps") and w1.get("cpu") and w2.get("cpu"):
        L.append(f"\n--workers 2 / 1 at medium, c=32: req/s {w2['rps'] / w1['rps']:.2f}x, "
                 f"CPU/request {w2['cpu'] / w1['cpu']:.2f}x (load generator and mock share "
                 "the 2 cores)")
    if "litellm" in targets:  # each memgate target against LiteLLM, as the verdicts below
        def times(t: str, p: str, key: str) -> float | None:
            mg, le = med_tab.get((t, p), {}), med_tab.get(("litellm", p), {})
            return le[key] / mg[key] if mg.get(key) and le.get(key) else None

        for t in [x for x in targets if x.startswith("memgate")]:
            L.append(f"{t} vs litellm, x lower added p50 latency / CPU per request: "
                     + ", ".join(f"{p} {f(times(t, p, 'add50'), '.1f')} / "
                                 f"{f(times(t, p, 'cpu'), '.1f')}" for p in payloads))
    L.append("\n#22 targets (memgate = eviction on, 1 worker; median of the rounds):")
    L += verdicts
    return "\n".join(L)


def mark(what: str, value: float | None, ok: bool) -> str:
    return f"  {'MET  ' if ok else 'UNMET'} {what}: {f(value, '.3f')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--stream-requests", type=int, default=100)
    ap.add_argument("--payloads", default=PAYLOADS)
    ap.add_argument("--targets", default=TARGETS)
    ap.add_argument("--max-minutes", type=float, default=15, help="per round")
    ap.add_argument("--out", default="/tmp/bench-peers", help="results, logs, report")
    ap.add_argument("--report-only", action="store_true", help="re-report the saved rounds")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    targets, payloads = a.targets.split(","), a.payloads.split(",")
    if a.report_only:
        rounds = [json.loads(p.read_text()) for p in sorted(out.glob("round*.json"))]
    else:
        mod = load_harness()
        cfg, nokey = memgate_config(out), memgate_config(out, None)
        variants = {t: memgate_config(out, variant=VARIANTS[t]) for t in targets
                    if t in VARIANTS}
        rounds = [one_round(mod, k, a, cfg, nokey, out, variants) for k in range(a.rounds)]
    text = report(rounds, targets, payloads)
    (out / "report.txt").write_text(text + "\n")
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
