#!/usr/bin/env python3
"""How often does eviction change the forwarded prefix? Naive sliding window vs stepped cut.

    python tests/perf/eval_cache_stability.py \\
        [--bfcl ../shared/data/bfcl/long_context_payloads.jsonl]

Replays growing sessions (each request = the previous history + one turn)
through the planner and reports, per budget and policy:

- changed: share of requests (after a session's first) whose forwarded messages
  do not start with the previous request's forwarded messages (but the history the
  fill recalled for that request's question, forwarded after its stable prefix) — a
  prompt-cache miss from that point on;
- reused: mean share of forwarded tokens that are the previous request's prefix;
- fwd tokens: mean tokens forwarded;
- over: requests over the budget (must be 0 unless system + current turn alone exceed it);
- changes / limit: the stepped cut's own limit is one prefix change per step of growth,
  a step being (1 - low_water) x the budget (max_tokens, the budget these runs set). Per
  session, from its first request that drops history (the first cut, a change every
  policy pays once) to its last, growth = the tokens the history grew by, as the planner
  counts them (compacted tool results as forwarded), and limit = growth / step; the
  column is the changes after the first cut over the sum of those limits. 1.0 is the
  grid's own bound (turns are whole: a turn bigger than a step moves the cut by itself).

Sessions: a synthetic 300-turn coding session, and (if given) the BFCL
long-context payloads replayed turn by turn.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers

if __package__ in (None, ""):  # run as a file (python tests/perf/X.py): the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # makes tests importable

from tests.perf.shared_data import require

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(500_000)


def synthetic_session(turns: int = 300, seed: int = 11, tools: bool = True) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    words = ("gateway token budget cache prefix request stream tool result file path "
             "config reload session turn history evict pin 订单 汇总 路径").split()

    def text(lo: int, hi: int) -> str:
        return " ".join(rnd.choice(words) for _ in range(rnd.randint(lo, hi)))

    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 20}]
    for t in range(turns):
        msgs.append({"role": "user", "content": text(5, 60)})
        for k in range(rnd.choice([0, 0, 1, 2]) if tools else 0):
            cid = f"c{t}_{k}"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": "read_file", "arguments": json.dumps({"p": text(1, 3)})}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "content": text(20, 600)})
        msgs.append({"role": "assistant", "content": text(10, 120)})
    return msgs


def requests_of(msgs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Every prefix that ends with a user message: what a client sends turn by turn."""
    return [msgs[: i + 1] for i, m in enumerate(msgs) if m["role"] == "user"]


def replay(sessions: list[list[dict[str, Any]]], budget: int, low_water: float,
           tools: list[Any] | None = None, share: float | None = 0.0) -> dict[str, float]:
    """`share`: the fill's recall_share (None: the shipped one)."""
    fill = {} if share is None else {"recall_share": share}
    rules = build_rules({"memory": {"enable_eviction": True, "budget": {
        "max_tokens": budget, "max_chars": None, "max_messages": None, "max_turns": None},
        "eviction": {"low_water": low_water, **fill}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
    changed = follow = over = fallback = 0
    reused: list[float] = []
    forwarded: list[int] = []
    after_cut = 0  # prefix changes after each session's first cut
    limit = 0.0  # the changes one per step of growth allows, summed over sessions
    step = (1.0 - low_water) * budget
    for msgs in sessions:
        prev: tuple[int, ...] | None = None
        stable = 0
        first_cut: int | None = None  # history tokens at the session's first cut
        grown = 0
        for history in requests_of(msgs):
            body: dict[str, Any] = {"model": "gpt-4o-mini", "messages": history}
            if tools:
                body["tools"] = tools
            raw = orjson.dumps(body)
            d = decide(raw, orjson.loads(raw), rules, TOK)
            assert d.plan is not None
            kept = tuple(d.forwarded())
            tokens = [d.message_tokens(i) for i in kept]
            forwarded.append(sum(tokens) + d.overhead_tokens())
            if d.plan.over_budget:
                over += 1
            fallback += d.plan.fill_fallback
            if prev is not None:
                follow += 1
                same = 0
                while same < min(len(prev), len(kept)) and prev[same] == kept[same]:
                    same += 1
                if same < stable:  # the recalled part is the question's, not the prefix
                    changed += 1
                    after_cut += first_cut is not None
                reused.append(sum(tokens[:same]) / max(1, sum(tokens)))
            prev = kept
            stable = kept.index(d.plan.recalled[0]) if d.plan.recalled else len(kept)
            if first_cut is None and d.plan.dropped:
                first_cut = grown = sum(map(d.planned_tokens, range(len(history))))
            elif first_cut is not None:
                grown = sum(map(d.planned_tokens, range(len(history))))
        if first_cut is not None and step > 0:
            limit += (grown - first_cut) / step
    return {
        "requests": len(forwarded),
        "changed": changed / max(1, follow),
        "reused": statistics.mean(reused) if reused else 0.0,
        "fwd_tokens": statistics.mean(forwarded),
        "over": over,
        "fallback": fallback,
        "after_cut": after_cut,
        "limit": limit,
    }


def table(title: str, sessions: list[list[dict[str, Any]]], budgets: list[int],
          tools: list[Any] | None = None) -> None:
    print(f"\n### {title}\n")
    print("| budget | policy | requests | prefix changed | 1 in N | prefix tokens reused |"
          " tokens forwarded | over budget | fill fallback | changes / limit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for budget in budgets:
        rows: tuple[tuple[str, float, float | None], ...] = (
            ("sliding (low_water 1.0)", 1.0, 0.0),
            ("stepped (low_water 0.6)", 0.6, 0.0),
            ("stepped + fill (shipped recall_share)", 0.6, None))
        for name, lw, share in rows:
            r = replay(sessions, budget, lw, tools, share)
            one_in = f"{1 / r['changed']:.1f}" if r["changed"] else "-"
            vs = (f"{r['after_cut']:.0f} / {r['limit']:.1f} = {r['after_cut'] / r['limit']:.2f}x"
                  if r["limit"] else "-")
            print(f"| {budget} | {name} | {r['requests']} | {r['changed']:.1%} | {one_in} |"
                  f" {r['reused']:.1%} | {r['fwd_tokens']:.0f} | {r['over']} | {r['fallback']} |"
                  f" {vs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bfcl", type=Path, default=None)
    args = ap.parse_args()
    if args.bfcl:
        require("--bfcl", args.bfcl)
    table("synthetic 300-turn chat (no tools, ~110 tokens a turn)",
          [synthetic_session(tools=False)], [2000, 4000, 8000])
    table("synthetic 300-turn coding session (tool results, ~500 tokens a turn)",
          [synthetic_session()], [2000, 4000, 8000, 16000])
    if args.bfcl:
        rows = [json.loads(line) for line in args.bfcl.read_text().splitlines() if line]
        sessions = [r["messages"] for r in rows]
        table(f"BFCL long-context ({len(rows)} sessions)", sessions, [4000, 8000, 16000],
              rows[0].get("tools"))


if __name__ == "__main__":
    main()
