#!/usr/bin/env python3
"""A/B of the eviction-on decision, recall on: two checkouts, interleaved (not a test).

    python tests/perf/bench_fill_ab.py /work/main /work/wt/fast [--rounds 7]
    python tests/perf/bench_fill_ab.py /work/main /work/main --b-off plancache --unique

Each round runs one subprocess per checkout (alternating which goes first), timing the
CPU time of `decide()` for a growing session's request (the history cache holds the
previous one: the server's warm path, `session+1` in bench_plan.py) at 60 / 300 /
2,000 messages with the shipped rules/gateway.yaml, eviction on. `--unique`: instead,
requests that share their history and differ only in the last user message (as
bench_gateway's and `wrk --unique` do: the cache holds every message but the last).
`--a-off` / `--b-off`: MEMGATE_SHORTCUTS_OFF for that side (A/B of one checkout with a
shortcut off). Prints the median over rounds of the per-round medians, and B/A. Same
run, same machine load for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, statistics, sys, time
import orjson, yaml
from tests.perf.bench_plan import ROOT, history
from gateway.decide.chat import decide
from gateway.decide.history import HistoryCache
from gateway.config.env_overrides import apply_env
from gateway.config.rules import build_rules
from gateway.measure.tokens import Tokenizers
out = {}
off, unique = sys.argv[3], sys.argv[4] == "1"
for n in map(int, sys.argv[1].split(",")):
    cfg = yaml.safe_load((ROOT / "rules/gateway.yaml").read_text())
    cfg["memory"]["enable_eviction"] = True  # the shipped config, eviction on
    rules = build_rules(cfg, base_dir=ROOT)
    if off:
        rules = apply_env(rules, {"MEMGATE_SHORTCUTS_OFF": off})
    msgs = history(n)
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    grown = orjson.dumps({"model": "gpt-4o-mini", "messages": [
        *msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]})
    tok, cache = Tokenizers(200_000), HistoryCache(1 << 30, 16)
    samples = []
    fwd = None
    for k in range(int(sys.argv[2])):
        if unique:  # the same history, a new last question: parsed once, counted once
            msgs[-1] = {"role": "user", "content": f"What next, {k}?"}
            grown = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
            if not k:
                decide(grown, orjson.loads(grown), rules, tok, history=cache, key=("t", "s"))
        else:
            decide(raw, orjson.loads(raw), rules, tok, history=cache, key=("t", "s"))
        body = orjson.loads(grown)
        t0 = time.process_time_ns()
        d = decide(grown, body, rules, tok, history=cache, key=("t", "s"))
        samples.append(time.process_time_ns() - t0)
        fwd = d.forward
    out[n] = [statistics.median(samples) / 1e6, len(fwd or b""), hash(fwd)]  # the last forward
print(json.dumps(out))
'''


def run(tree: str, sizes: str, repeat: int, off: str = "", unique: bool = False
        ) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
    res = subprocess.run([sys.executable, "-c", CHILD, sizes, str(repeat), off,
                          "1" if unique else "0"], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--sizes", default="60,300,2000")
    ap.add_argument("--a-off", default="", help="MEMGATE_SHORTCUTS_OFF for A")
    ap.add_argument("--b-off", default="", help="MEMGATE_SHORTCUTS_OFF for B")
    ap.add_argument("--unique", action="store_true",
                    help="same history, a new last user message per request")
    args = ap.parse_args()
    sides = {"A": (args.a, args.a_off), "B": (args.b, args.b_off)}
    got: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for r in range(args.rounds):
        for side in (("A", "B") if r % 2 == 0 else ("B", "A")):
            tree, off = sides[side]
            for n, (ms, _size, h) in run(tree, args.sizes, args.repeat, off,
                                         args.unique).items():
                got[side].setdefault(n, []).append(ms)
                got[side].setdefault(n + ":fwd", []).append(h)
    print(f"{'messages':>9} {'A ms':>8} {'B ms':>8} {'B/A':>6} {'same forward':>13}")
    for n in args.sizes.split(","):
        a, b = statistics.median(got["A"][n]), statistics.median(got["B"][n])
        same = got["A"][n + ":fwd"] == got["B"][n + ":fwd"]
        print(f"{n:>9} {a:>8.3f} {b:>8.3f} {b / a:>6.2f} {str(same):>13}")


if __name__ == "__main__":
    main()
