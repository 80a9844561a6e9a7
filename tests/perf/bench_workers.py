#!/usr/bin/env python3
"""Requests per second and CPU per request: memgate --workers 1 vs --workers 2 vs a bare
aiohttp passthrough, same nginx upstream, same wrk load, one run (loopback only).

    python tests/perf/bench_workers.py [--seconds 5] [--rounds 3] [--connections 32]

Needs `nginx` and `wrk` on PATH (Debian: apt-get install nginx wrk). The upstream is
nginx (one worker, a fixed answer, the request body discarded) and the load generator is
wrk (C, one thread) posting the medium payload with a per-request counter in the last
message, so no two bodies are equal. Both are measured too: their CPU per second of load
is printed, so a run where either nears a whole core (the load generator, not the
gateway, being the limit) is visible. The targets take turns, `--rounds` times, and the
median round is reported; eviction is on. CPU per request = CPU time of the target's
processes (parent and workers: its process group, from /proc) during the run / requests.
On a shared 2-core box read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_gateway import PASSTHROUGH, REPLY, Proc, body, free_port, history

LUA = r"""
local prefix, suffix, n = nil, nil, 0
function init(args)
   local f = assert(io.open(args[1], "rb")); local b = f:read("*a"); f:close()
   local at = assert(string.find(b, "and now?", 1, true))
   prefix, suffix = string.sub(b, 1, at - 1), string.sub(b, at)
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
   wrk.headers["Authorization"] = "Bearer sk-bench"
end
function request()
   n = n + 1
   return wrk.format(nil, nil, nil, prefix .. "[req " .. n .. "] " .. suffix)
end
function done(summary, latency, requests)
   io.write(string.format("WRK %d %d %d %d\n", summary.requests, summary.duration,
      summary.errors.status, summary.errors.connect + summary.errors.read +
      summary.errors.write + summary.errors.timeout))
end
"""
NGINX = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_max_body_size 16m;
    client_body_buffer_size 16m;
    client_body_temp_path {dir}/body;
    keepalive_requests 10000000;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{ default_type application/json; return 200 '{reply}'; }}
    }}
}}
"""


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def wrk(url: str, script: Path, payload: Path, seconds: float, conns: int) -> tuple[int, float]:
    """(requests, wrk's own CPU seconds) of one wrk run; any error response aborts."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s",
                          "-s", str(script), url, "--", str(payload)],
                         capture_output=True, text=True, timeout=seconds + 30, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    m = re.search(r"^WRK (\d+) (\d+) (\d+) (\d+)$", out, re.M)
    assert m is not None, out
    requests, _, bad, errors = map(int, m.groups())
    assert bad == 0 and errors == 0, out
    return requests, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--messages", type=int, default=60, help="history length (60: medium)")
    args = ap.parse_args()
    py = sys.executable
    root = Path(__file__).resolve().parents[2]
    tmp = Path(tempfile.mkdtemp(prefix="memgate-bench-workers-"))
    script, payload = tmp / "post.lua", tmp / "body.json"
    script.write_text(LUA)
    payload.write_bytes(body(history(args.messages)))
    up_port = free_port()
    (tmp / "nginx.conf").write_text(NGINX.format(dir=tmp, port=up_port, reply=REPLY.decode()))
    upstream = f"http://127.0.0.1:{up_port}"
    procs = [Proc(["nginx", "-p", str(tmp), "-c", str(tmp / "nginx.conf")], up_port)]
    env = {"MEMGATE_ENABLE_EVICTION": "1", "MEMGATE_LOG_FORMAT": "json",
           "PYTHONPATH": str(root)}
    try:
        targets: dict[str, Proc] = {}
        pt = free_port()
        targets["passthrough"] = Proc([py, "-c", PASSTHROUGH, str(pt), upstream], pt)
        for n in (1, 2):
            port = free_port()
            targets[f"memgate-{n}w"] = Proc(
                [py, "-m", "gateway", "serve", "--port", str(port), "--upstream", upstream,
                 "--workers", str(n)], port, env, log=tmp / f"memgate-{n}w.log")
        # one process writing its metrics as a worker does (shared files): what of a worker's
        # CPU per request is the multiprocess metrics, what is running two at once
        sys.path.insert(0, str(root))
        from gateway.proxy.workers import metrics_dir

        mp = metrics_dir()  # where --workers puts them
        port = free_port()
        targets["memgate-1w-mpfiles"] = Proc(
            [py, "-m", "gateway", "serve", "--port", str(port), "--upstream", upstream], port,
            {**env, "PROMETHEUS_MULTIPROC_DIR": str(mp)}, log=tmp / "memgate-mp.log")
        procs += targets.values()
        time.sleep(8)  # every worker listening (the port answers once the first one does)
        for proc in targets.values():  # warm-up: tokenizers, caches, connection pools
            wrk(f"http://127.0.0.1:{proc.port}/v1/chat/completions", script, payload, 2,
                args.connections)
        runs: dict[str, list[tuple[float, float]]] = {t: [] for t in targets}
        load = []
        for r in range(args.rounds):
            order = list(targets.items())
            for name, proc in order[r % len(order):] + order[:r % len(order)]:
                c0, u0 = group_cpu_s(proc.p.pid), group_cpu_s(procs[0].p.pid)
                n_req, wrk_cpu = wrk(f"http://127.0.0.1:{proc.port}/v1/chat/completions",
                                     script, payload, args.seconds, args.connections)
                cpu = group_cpu_s(proc.p.pid) - c0
                load.append((name, wrk_cpu / args.seconds,
                             (group_cpu_s(procs[0].p.pid) - u0) / args.seconds))
                runs[name].append((n_req / args.seconds, cpu / n_req * 1e6))
        print(f"payload {payload.stat().st_size} bytes ({args.messages} messages), "
              f"c={args.connections}, {args.rounds} rounds x {args.seconds:g} s, "
              f"{len(os.sched_getaffinity(0))} CPUs, eviction on")
        # cores = req/s x CPU per request: well under the worker count means the target was
        # starved (a shared box) or waited, not CPU-bound: then req/s ratios say little
        print(f"{'target':<18} {'req/s':>8} {'cpu us/req':>11} {'rps/pt':>7} {'cpu/pt':>7} "
              f"{'cores':>6}")
        med = {t: (statistics.median(x for x, _ in v), statistics.median(c for _, c in v))
               for t, v in runs.items()}
        pt_rps, pt_cpu = med["passthrough"]
        for t, (rps, cpu) in med.items():
            print(f"{t:<18} {rps:>8.0f} {cpu:>11.0f} {rps / pt_rps:>7.2f} {cpu / pt_cpu:>7.2f} "
                  f"{rps * cpu / 1e6:>6.2f}")
        one, two = med["memgate-1w"], med["memgate-2w"]
        print(f"\n2 workers / 1 worker: req/s {two[0] / one[0]:.2f}x, "
              f"CPU per request {two[1] / one[1]:.2f}x (of which the shared metric files: "
              f"{med['memgate-1w-mpfiles'][1] / one[1]:.2f}x)")
        for name in targets:
            w = [x for t, x, _ in load if t == name]
            u = [y for t, _, y in load if t == name]
            print(f"load generator under {name}: wrk {max(w):.2f} cores at most, "
                  f"nginx {max(u):.2f}")
    finally:
        for p in procs:
            if p.p.poll() is None:
                os.killpg(p.p.pid, signal.SIGTERM)
                try:
                    p.p.wait(40)
                except subprocess.TimeoutExpired:
                    os.killpg(p.p.pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(tmp), *(str(d) for d in Path("/dev/shm").glob(
            f"memgate-metrics-{os.getpid()}-*"))], check=False)


if __name__ == "__main__":
    main()
