#!/usr/bin/env python3
"""Evidence retention on LoCoMo: recency-only vs memgate (eviction, fill, store recall).

    python tests/perf/eval_locomo.py --data ../shared/data [--budgets 2000,4000,8000]
        [--recall-share 0.5] [--low-water 0.6] [--token-only] [--only-fill] [--no-reuse]
        [--phases]

Converts the LoCoMo dev conversations with the data set's own script (one request
per QA item: full history + the question), runs every request through memgate's
decision path (`decide`, and for the store-recall row recall over the turns the
request drops: what the gateway forwards when `store.recall` is on and nothing was
archived yet), writes what would be forwarded, and scores it with the data set's
evaluator against the evaluator's recency-only baseline at the same budgets.

The rules are the shipped rules/gateway.yaml with eviction on and `max_tokens` set to
each budget: every other limit as shipped (`max_chars`, `max_messages`, `max_turns`);
`--token-only` turns those three off (the token budget alone). Rows: eviction without
the fill (today's), with store recall, and with the budget-filling recall (the shipped
eviction defaults unless --recall-share / --low-water say otherwise). Next to each row
the prompt-cache cost of the same rules: prefix tokens reused on the synthetic chat
session of eval_cache_stability.py replayed turn by turn (`reused`), and how often its
stable prefix changed (`changed`).

`--phases` also runs the fill row at each budget x (1 -+ 2.5%, 1 -+ 1.25%) and prints the
mean of the five: the data set is five conversations, each with one fixed history, so one
budget catches each history at one phase of the stepped cut (how much of the budget the
stable part holds between two cut points), and moving the budget by 1% moves retention by
up to ~1.5 points; the mean is the steadier figure to compare rules by.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway.config.rules import build_rules
from gateway.config.schema import Rules, StoreRules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from gateway.memory.recall import recall

if __package__ in (None, ""):  # run as a file (python tests/perf/X.py): the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # makes tests importable

from tests.perf.eval_cache_stability import requests_of, synthetic_session
from tests.perf.shared_data import default_data_dir, require

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "rules" / "gateway.yaml"
TOK = Tokenizers(500_000)


def eval_rules(budget: int, eviction: dict[str, Any], token_only: bool = False) -> Rules:
    """The shipped config with eviction on, `max_tokens: budget` and `eviction` over it."""
    data = yaml.safe_load(SHIPPED.read_text())
    memory = data["memory"]
    memory["enable_eviction"] = True
    memory["budget"]["max_tokens"] = budget
    if token_only:
        memory["budget"].update(max_chars=None, max_messages=None, max_turns=None)
    memory["eviction"].update(eviction)
    return build_rules(data, str(SHIPPED), base_dir=SHIPPED.parent)


def forward_all(payloads: Path, rules: Rules, top_k: int, out: Path) -> int:
    """Write the forwarded bodies; the number of requests over the budget."""
    budget = rules.memory.budget.max_tokens
    assert isinstance(budget, int)
    store_rules = replace(StoreRules(), recall_enabled=True, recall_top_k=top_k)
    over = 0
    with out.open("wb") as f:
        for line in payloads.read_bytes().splitlines():
            body = orjson.loads(line)
            d = decide(line, body, rules, TOK)
            if top_k and d.plan is not None and d.plan.dropped:
                recalled = asyncio.run(recall(None, store_rules, "eval", "eval", d))
                if recalled:
                    d = decide(line, body, rules, TOK, recalled=recalled)
            assert d.plan is not None
            # the budget counts the history on top of the floor (Plan.fixed_tokens)
            history = (d.plan.kept_tokens or 0) - (d.plan.fixed_tokens or 0)
            over += d.plan.over_budget or (d.plan.fixed_tokens is not None and history > budget)
            f.write(d.forward + b"\n")
    return over


def reuse(rules: Rules, sessions: list[list[dict[str, Any]]]) -> tuple[float, float]:
    """(prefix tokens reused, stable prefix changed) over the sessions replayed turn by
    turn, as eval_cache_stability.py defines them (the recalled part is the question's)."""
    reused: list[float] = []
    changed = follow = 0
    for msgs in sessions:
        prev: tuple[int, ...] | None = None
        stable = 0
        for history in requests_of(msgs):
            raw = orjson.dumps({"model": "gpt-4o-mini", "messages": history})
            d = decide(raw, orjson.loads(raw), rules, TOK)
            assert d.plan is not None
            kept = tuple(d.forwarded())
            tokens = [d.message_tokens(i) for i in kept]
            if prev is not None:
                follow += 1
                same = 0
                while same < min(len(prev), len(kept)) and prev[same] == kept[same]:
                    same += 1
                changed += same < stable
                reused.append(sum(tokens[:same]) / max(1, sum(tokens)))
            prev = kept
            stable = kept.index(d.plan.recalled[0]) if d.plan.recalled else len(kept)
    return statistics.mean(reused), changed / max(1, follow)


def summary(data: dict[str, Any]) -> dict[str, float]:
    result: dict[str, float] = next(iter(data["results"].values()))["overall"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--budgets", default="2000,4000,8000")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--recall-share", type=float, default=None,
                    help="the fill's share of the budget (default: the shipped one)")
    ap.add_argument("--low-water", type=float, default=None,
                    help="memory.eviction.low_water for the fill row (default: shipped)")
    ap.add_argument("--token-only", action="store_true",
                    help="max_chars, max_messages, max_turns off: the token budget alone")
    ap.add_argument("--only-fill", action="store_true", help="skip the rows without the fill")
    ap.add_argument("--no-reuse", action="store_true", help="skip the prompt-cache replay")
    ap.add_argument("--phases", action="store_true",
                    help="also the fill row at budget x (1 -+ 2.5%%, 1 -+ 1.25%%), and the mean")
    args = ap.parse_args()
    require("--data", args.data / "locomo_to_payloads.py", args.data / "retention.py",
            args.data / "locomo" / "locomo_dev.json")
    fill: dict[str, Any] = {}
    if args.recall_share is not None:
        fill["recall_share"] = args.recall_share
    if args.low_water is not None:
        fill["low_water"] = args.low_water
    today = {"low_water": 1.0, "recall_share": 0.0}
    policies = [] if args.only_fill else [
        ("memgate eviction, no recall", 0, today),
        (f"memgate + store recall of dropped turns (top_k {args.top_k})", args.top_k, today)]
    policies.append((f"memgate + fill {fill or 'shipped defaults'}", 0, fill))
    work = Path(tempfile.mkdtemp(prefix="memgate-locomo-"))
    subprocess.run([sys.executable, str(args.data / "locomo_to_payloads.py"), "--input",
                    str(args.data / "locomo" / "locomo_dev.json"), "--out-dir", str(work)],
                   check=True, capture_output=True)
    payloads, side = work / "payloads.jsonl", work / "side.jsonl"
    evaluator = [sys.executable, str(args.data / "retention.py"), "--original", str(payloads),
                 "--side", str(side)]
    chat = [synthetic_session(tools=False)]
    print(f"caps: {'token budget only' if args.token_only else 'as shipped'}")
    print("| budget | policy | macro retention | micro | all evidence | fwd tokens |"
          " over budget | chat prefix reused | chat prefix changed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for budget in [int(b) for b in args.budgets.split(",")]:
        runs: list[tuple[str, list[str], int | str, str, str]] = [
            ("recency baseline (evaluator)",
             ["--baseline", "recency", "--budget", str(budget)], "-", "-", "-")]
        for k, (name, top_k, eviction) in enumerate(policies):
            rules = eval_rules(budget, eviction, args.token_only)
            fwd = work / f"fwd_{budget}_{k}.jsonl"
            over = forward_all(payloads, rules, top_k, fwd)
            reused = changed = "-"
            if not args.no_reuse and not top_k:
                r, c = reuse(rules, chat)
                reused, changed = f"{r:.1%}", f"{c:.1%}"
            runs.append((name, ["--forwarded", str(fwd)], over, reused, changed))
        for name, extra, over, reused, changed in runs:
            o = score(evaluator, extra, work)
            print(f"| {budget} | {name} | {o['macro']:.1%} | {o['micro']:.1%} | {o['all']:.1%} |"
                  f" {o['fwd_tok']:.0f} | {over} | {reused} | {changed} |", flush=True)
        if args.phases:
            macro = [o["macro"]]  # the last row printed is the fill's at `budget`
            for at in (round(budget * f) for f in (0.975, 0.9875, 1.0125, 1.025)):
                fwd = work / f"fwd_{at}_phase.jsonl"
                over = forward_all(payloads, eval_rules(at, fill, args.token_only), 0, fwd)
                o = score(evaluator, ["--forwarded", str(fwd)], work)
                macro.append(o["macro"])
                print(f"| {at} | {policies[-1][0]} | {o['macro']:.1%} | {o['micro']:.1%} |"
                      f" {o['all']:.1%} | {o['fwd_tok']:.0f} | {over} | - | - |", flush=True)
            print(f"| {budget} -+ 2.5% | mean of the five budgets | "
                  f"{statistics.mean(macro):.1%} | | | | | | |", flush=True)


def score(evaluator: list[str], extra: list[str], work: Path) -> dict[str, float]:
    out = work / "r.json"
    subprocess.run([*evaluator, *extra, "--json-out", str(out)], check=True,
                   capture_output=True)
    return summary(json.loads(out.read_text()))


if __name__ == "__main__":
    main()
