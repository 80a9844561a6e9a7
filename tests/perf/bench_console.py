#!/usr/bin/env python3
"""What the console costs a request, against planning the same request, in one run.

    python tests/perf/bench_console.py

Per history size: the time `decide` takes (parse, plan, build the forward: the
gateway's own work before forwarding, histories not cached) and the time the
console's observer takes for the same decision, as a ratio; then the time to
render the overview and a session page with every bound full (max_sessions
sessions of `ring` requests). The end-to-end view is `bench_gateway.py --console`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gateway import SIZES, history  # noqa: E402

from gateway.config.rules import build_rules  # noqa: E402
from gateway.config.schema import ConsoleRules  # noqa: E402
from gateway.decide.chat import decide  # noqa: E402
from gateway.measure.tokens import Tokenizers  # noqa: E402
from gateway.observe import console_view as view  # noqa: E402
from gateway.observe.console_log import Console  # noqa: E402


def per_call(fn: object, n: int) -> float:
    """Median of 5 rounds of n calls, seconds per call."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()  # type: ignore[operator]
        rounds.append((time.perf_counter() - t0) / n)
    return sorted(rounds)[2]


def main() -> None:
    rules = build_rules({"memory": {"enable_eviction": True, "budget": {
        "max_tokens": 2000, "max_chars": None, "max_messages": None, "max_turns": None}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
    tok = Tokenizers(200_000)
    console = Console(ConsoleRules(enabled=True))
    print(f"{'payload':<8} {'msgs':>5} | decide µs | observe µs | observe/decide")
    for name, n in SIZES.items():
        msgs = [*history(n), {"role": "user", "content": "and now?"}]
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        d = decide(raw, orjson.loads(raw), rules, tok)  # counts cached from here on
        fields = {"session": f"s-{name}", "req": "r", "est_tokens": d.est_tokens(),
                  "mode": "on", "status": 200, "overhead_ms": 1.0, "evict": d.plan.evict
                  if d.plan else "none", "kept": len(d.plan.kept) if d.plan else n,
                  "dropped": len(d.plan.dropped) if d.plan else 0, "model": "gpt-4o-mini"}
        k = max(5, 2000 // n)
        # per_call runs each lambda before the loop moves on; the defaults say so to ruff (B023)
        t_decide = per_call(lambda raw=raw: decide(raw, orjson.loads(raw), rules, tok), k)
        t_obs = per_call(lambda fields=fields, d=d: console.observe(fields, d, None), k * 20)
        print(f"{name:<8} {len(msgs):>5} | {t_decide * 1e6:>9.1f} | {t_obs * 1e6:>10.1f} | "
              f"{t_obs / t_decide:>14.3f}")
    full = Console(ConsoleRules(enabled=True, max_sessions=200, ring=20))
    msgs = [*history(300), {"role": "user", "content": "and now?"}]
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    d = decide(raw, orjson.loads(raw), rules, tok)
    for s in range(200):
        for r in range(20):
            full.observe({"session": f"s{s}", "req": f"r{r}", "est_tokens": 1000 + s,
                          "mode": "on", "status": 200, "overhead_ms": 1.0}, d, None)
    status = view.Status(rules, None, None, None, 0, 0, [])
    t_main = per_call(lambda: view.main_page(status, full.hour(), full.largest(), full.rules), 5)
    log = full.sessions["s0"]
    t_one = per_call(lambda: view.session_page("s0", log, full.rules), 5)
    print(f"\npages with 200 sessions x 20 requests kept: overview {t_main * 1000:.1f} ms, "
          f"one session {t_one * 1000:.1f} ms")


if __name__ == "__main__":
    main()
