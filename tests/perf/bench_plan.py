#!/usr/bin/env python3
"""Plan time per request vs history length (not a test: a benchmark to read).

    python tests/perf/bench_plan.py [--repeat 20]

For histories of 10 / 100 / 300 / 1,000 / 2,000 / 10,000 messages (tool calls,
pins, Chinese text), with a budget that evicts, it times `decide()` — parse,
plan, build the forwarded body — on first sight (empty token cache) and on a warm
session (the same history seen before, plus one new turn), the full `est_tokens`
count the [mem] line needs, and a session through the history cache (as the
server: the previous request parsed, counted and indexed, then the one grown by a
turn). Each size with the budget-filling recall off and on (`--recall-share`).
Ratios matter more than absolute times on a shared machine.

    python tests/perf/bench_plan.py --shortcuts [--sizes 60,300,2000]

instead A/Bs each planner shortcut (MEMGATE_SHORTCUTS_OFF planpass, plancache,
recallscan, toolscan) in one process: the shipped rules/gateway.yaml, eviction on, a
session through the history cache, requests alternating between all on and that one off
(each with its own cache), CPU time per `decide()`, medians; for a growing session (the
history + one turn per request) and for requests that resend the same history with a
new last question (as bench_gateway's do); also the warm per-request time along a
growing 2,000-message session (at 500 / 1,000 / 2,000 messages).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.decide.history import HistoryCache
from gateway.measure.tokens import Tokenizers

ROOT = Path(__file__).resolve().parents[2]
ZH = "请检查 /data/orders 目录下上周的数据，按状态汇总订单，看看有没有异常的分区。"
EN = ("The retry loop now uses exponential backoff with jitter; the pool is shared and "
      "tool results are trimmed before they are sent upstream.")


def history(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant."}]
    t = 0
    while len(msgs) < n - 1:
        t += 1
        text = (ZH if t % 5 == 0 else EN) + f" (turn {t}, {rnd.random():.6f})"
        msgs.append({"role": "user", "content": ("[PIN] " if t % 37 == 1 else "") + text})
        if t % 3 == 0:
            cid = f"call_{t}"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": "read_file", "arguments": f'{{"path": "/src/m{t}.py"}}'}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "content": EN * 4})
        msgs.append({"role": "assistant", "content": EN + f" [{t}]"})
    msgs = msgs[: n - 1]
    while msgs[-1]["role"] == "tool" or msgs[-1].get("tool_calls"):
        msgs.pop()
    msgs.append({"role": "user", "content": "What next?"})
    return msgs


def timed(fn: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--recall-share", type=float, default=0.5, help="the fill's share when on")
    ap.add_argument("--sizes", default="10,100,300,1000,2000,10000")
    ap.add_argument("--shortcuts", action="store_true", help="A/B the planner's shortcuts")
    args = ap.parse_args()
    if args.shortcuts:
        shortcuts([int(x) for x in args.sizes.split(",")], args.repeat)
        return
    print(f"{'messages':>9} {'fill':>5} {'bytes':>10} {'cold ms':>9} {'warm ms':>9}"
          f" {'warm+1 ms':>10} {'est_tokens cold ms':>19} {'est_tokens warm ms':>19}"
          f" {'session+1 ms':>13}")
    for n in [int(x) for x in args.sizes.split(",")]:
        for share in (0.0, args.recall_share):
            bench(n, share, args.repeat)


def bench(n: int, share: float, repeat: int) -> None:
    rules = build_rules({"memory": {"enable_eviction": True, "budget": {
        "max_tokens": 6000, "max_chars": None, "max_messages": None, "max_turns": None},
        "eviction": {"recall_share": share}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
    msgs = history(n)
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    grown = orjson.dumps({"model": "gpt-4o-mini",
                          "messages": [*msgs, {"role": "assistant", "content": "ok"},
                                       {"role": "user", "content": "and then?"}]})

    def cold() -> None:
        decide(raw, orjson.loads(raw), rules, Tokenizers(200_000))

    warm_tok = Tokenizers(200_000)
    decide(raw, orjson.loads(raw), rules, warm_tok)

    def warm() -> None:
        decide(raw, orjson.loads(raw), rules, warm_tok)

    def warm_grown() -> None:
        decide(grown, orjson.loads(grown), rules, warm_tok)

    def est_cold() -> None:
        decide(raw, orjson.loads(raw), rules, Tokenizers(200_000)).est_tokens()

    def est_warm() -> None:
        decide(raw, orjson.loads(raw), rules, warm_tok).est_tokens()

    cache = HistoryCache(1 << 30, 16)

    def session_grown() -> float:
        """The grown request of a session whose previous one the cache holds."""
        decide(raw, orjson.loads(raw), rules, warm_tok, history=cache, key=("t", "s"))
        body = orjson.loads(grown)
        t0 = time.perf_counter()
        decide(grown, body, rules, warm_tok, history=cache, key=("t", "s"))
        return time.perf_counter() - t0

    rep = max(3, repeat if n <= 2000 else repeat // 4)
    session = statistics.median(session_grown() for _ in range(rep)) * 1000
    print(f"{n:>9} {share:>5} {len(raw):>10} {timed(cold, rep):>9.3f} {timed(warm, rep):>9.3f}"
          f" {timed(warm_grown, rep):>10.3f} {timed(est_cold, rep):>19.3f}"
          f" {timed(est_warm, rep):>19.3f} {session:>13.3f}", flush=True)


PLAN_SHORTCUTS = ("planpass", "plancache", "recallscan", "toolscan")


def shipped(off: str = "") -> Any:
    import yaml

    from gateway.config.env_overrides import apply_env

    cfg = yaml.safe_load((ROOT / "rules/gateway.yaml").read_text(encoding="utf-8"))
    cfg["memory"]["enable_eviction"] = True  # the shipped config, eviction on
    rules = build_rules(cfg, base_dir=ROOT / "rules")
    return apply_env(rules, {"MEMGATE_SHORTCUTS_OFF": off}) if off else rules


def shortcuts(sizes: list[int], repeat: int) -> None:
    tok = Tokenizers(200_000)
    print(f"{'messages':>9} {'requests':>9} {'all on ms':>10} "
          + " ".join(f"{n + ' off':>15}" for n in PLAN_SHORTCUTS))
    for n in sizes:
        for kind in ("growing", "unique"):
            sides = {off: (shipped(off), HistoryCache(1 << 30, 16))
                     for off in ("", *PLAN_SHORTCUTS)}
            cpu: dict[str, list[int]] = {off: [] for off in sides}
            msgs = history(n)
            for k in range(max(repeat, 10) * 3):
                if kind == "growing":  # the previous request, then this one grown by a turn
                    bodies = [msgs, [*msgs, {"role": "assistant", "content": f"ok {k}"},
                                     {"role": "user", "content": f"and then {k}?"}]]
                else:  # the same history, a new last question
                    bodies = [[*msgs[:-1], {"role": "user", "content": f"what next, {k}?"}]]
                raws = [orjson.dumps({"model": "gpt-4o-mini", "messages": b}) for b in bodies]
                for off in (sides if k % 2 else reversed(list(sides))):
                    rules, cache = sides[off]
                    for raw in raws[:-1]:
                        decide(raw, orjson.loads(raw), rules, tok, history=cache, key=("t", "s"))
                    body = orjson.loads(raws[-1])
                    t0 = time.process_time_ns()
                    decide(raws[-1], body, rules, tok, history=cache, key=("t", "s"))
                    cpu[off].append(time.process_time_ns() - t0)
            med = {off: statistics.median(v[3:]) / 1e6 for off, v in cpu.items()}
            print(f"{n:>9} {kind:>9} {med['']:>10.3f} " + " ".join(
                f"{med[o]:>8.3f} {med[o] / med['']:>5.2f}x" for o in PLAN_SHORTCUTS), flush=True)
    rules, cache = shipped(), HistoryCache(1 << 30, 16)
    msgs = history(40)
    per: dict[int, list[int]] = {}
    t = 0
    while len(msgs) < 2000:  # one session growing a turn per request, warm
        t += 1
        msgs += [{"role": "assistant", "content": EN + f" [{t}]"},
                 {"role": "user", "content": (ZH if t % 5 == 0 else EN) + f" (grown {t})"}]
        raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
        body = orjson.loads(raw)
        t0 = time.process_time_ns()
        decide(raw, body, rules, tok, history=cache, key=("t", "g"))
        per.setdefault(len(msgs) // 500 * 500, []).append(time.process_time_ns() - t0)
    print("growing session, warm, shipped rules: ms per request at "
          + ", ".join(f"~{k}: {statistics.median(v) / 1e6:.3f}" for k, v in sorted(per.items())
                      if k))


if __name__ == "__main__":
    main()
