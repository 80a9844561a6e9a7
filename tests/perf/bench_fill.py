#!/usr/bin/env python3
"""Warm decision time of a growing session with the budget-filling recall off and on.

    PYTHONPATH=. python tests/perf/bench_fill.py [--sizes 100,500,2000] [--requests 60]

A session of N messages (bench_plan's history: tool calls, pins, Chinese text) grows
by one turn per request, through the history cache as in the server (the previous
request parsed, counted and indexed). Per size, the lower quartile of `decide()`'s time
over the requests after the first few (the machine is shared: the upper half is
other processes' time), with recall_share 0 and 0.1 timed alternately
(measured in the same moments). The fill's part
(on − off) should not grow with N: its index is extended by the new turn only, and
scoring reads only the question's terms' newest groups. Not a test: a benchmark to
read; run it on the base commit too for a before/after.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.decide.history import HistoryCache
from gateway.measure.tokens import Tokenizers

if __package__ in (None, ""):  # run as a file (python tests/perf/X.py): the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # makes tests importable

from tests.perf.bench_plan import history

ROOT = Path(__file__).resolve().parents[2]


def session(n: int, requests: int) -> list[tuple[bytes, Any]]:
    """The session's bodies: n messages, then one turn more per request."""
    msgs = history(n)[:-1]
    out = []
    for k in range(requests):
        msgs = [*msgs, {"role": "user", "content": f"question {k}: the retry backoff of "
                        f"the pool in m{k * 3}.py?"}]
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        out.append((raw, orjson.loads(raw)))
        msgs = [*msgs, {"role": "assistant", "content": f"answer {k}: it is shared"}]
    return out


planner = importlib.import_module("gateway.policy.plan")
FILL_TIME: list[float] = []


def _timed_fill() -> None:
    """Time the fill itself (ranking and restoring) inside each decision."""
    fill = getattr(planner, "fill_from_request", None)
    if fill is None:
        return

    def timed(*args: Any) -> None:
        t0 = time.perf_counter()
        fill(*args)
        FILL_TIME.append(time.perf_counter() - t0)

    setattr(planner, "fill_from_request", timed)  # noqa: B010 (a module's function)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="100,500,2000")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--share", type=float, default=0.1)
    args = ap.parse_args()
    _timed_fill()
    print(f"{'messages':>9} {'off ms':>8} {'on ms':>8} {'on - off ms':>12}"
          f" {'fill_from_request ms':>21}")
    for n in [int(x) for x in args.sizes.split(",")]:
        bodies = session(n, args.requests)
        runs = []
        for share in (0.0, args.share):
            rules = build_rules({"memory": {"enable_eviction": True, "budget": {
                "max_tokens": 6000, "max_chars": None, "max_messages": None,
                "max_turns": None}, "eviction": {"recall_share": share}},
                "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
            runs.append((rules, Tokenizers(200_000), HistoryCache(1 << 30, 16)))
        times: list[list[float]] = [[], []]
        del FILL_TIME[:]
        for k, (raw, body) in enumerate(bodies):
            for j, (rules, tok, cache) in enumerate(runs):
                gc.collect()  # one run's garbage is not collected in the other's time
                t0 = time.perf_counter()
                decide(raw, body, rules, tok, history=cache, key=("t", "s"))
                if k >= 5:  # the first ones count and index the history
                    times[j].append(time.perf_counter() - t0)
        # the lower quartile: on a loaded machine the upper half is other processes' time
        off, on = (statistics.quantiles(t, n=4)[0] * 1000 for t in times)
        fill = statistics.quantiles(FILL_TIME[5:], n=4)[0] * 1000 if len(FILL_TIME) > 8 else 0.0
        print(f"{n:>9} {off:>8.3f} {on:>8.3f} {on - off:>12.3f} {fill:>21.3f}", flush=True)


if __name__ == "__main__":
    main()
