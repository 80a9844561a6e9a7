#!/usr/bin/env python3
"""What eviction keeps of agent traffic: BFCL multi-turn long-context payloads.

    python tests/perf/eval_bfcl.py --data ../shared/data [--budget 4000] [--set long_context]

Every payload (tool schemas, an agent's tool calls and their executed results, the
last user request) goes through memgate's decision path (`decide`, as the server)
under each policy, and the forwarded body is scored:

- earlier user requests kept: the side file's evidence texts (the user requests
  before the last one) found verbatim (whitespace-normalised) in some string of the
  forwarded request, the data set's own retention rule (retention.py);
- tool-output content kept: of every tool result in the original history, its JSON
  string and number leaves (or, when it is not JSON, its non-empty lines) that are
  still substrings of the forwarded request, as a share of all of them (micro) and
  as the mean of the per-payload shares (macro);
- invalid requests: a tool call without all its results right after it, a result
  without its call, or a first non-system message that is not the user's;
- history over budget: the forwarded tokens less the floor (the system part, the tool
  schemas and the current turn, which the budget does not count) above the budget;
- floor over budget: requests whose floor alone exceeds the budget (before the budget
  counted the history only, each of these was cut to the floor).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision, current_turn_start
from gateway.measure.tokens import Tokenizers
from tests.perf.shared_data import default_data_dir, require

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["pinned", "recent_turns", "compact_tools", "length"]  # rules/gateway.yaml's order
POLICIES: list[tuple[str, dict[str, Any]]] = [
    ("today: drop_unit turn, no fill", {"drop_unit": "turn", "recall_share": 0.0}),
    ("today: drop_unit group, no fill", {"drop_unit": "group", "recall_share": 0.0}),
    ("fill: drop_unit turn, shipped share", {"drop_unit": "turn"}),
    ("fill: drop_unit group, shipped share", {"drop_unit": "group"}),
    ("shipped order (compact_tools): drop_unit turn", {"drop_unit": "turn", "order": SHIPPED}),
    ("shipped order (compact_tools): drop_unit group", {"drop_unit": "group", "order": SHIPPED}),
]


def leaves(content: Any) -> list[str]:
    """A tool result's units of content: JSON string/number leaves, else non-empty lines."""
    if not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
    try:
        value = json.loads(content)
    except ValueError:
        return [ln.strip() for ln in content.splitlines() if ln.strip()]
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            if v.strip():
                out.append(v)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out.append(json.dumps(v))
    if isinstance(value, dict | list):
        walk(value)
    else:
        out = [ln.strip() for ln in content.splitlines() if ln.strip()]
    return out


def invalid(msgs: list[dict[str, Any]]) -> bool:
    first = next((m for m in msgs if m.get("role") not in ("system", "developer")), None)
    if first is None or first.get("role") != "user":
        return True
    j = 0
    while j < len(msgs):
        m = msgs[j]
        if m.get("role") == "tool":
            return True  # a result not right after its call
        ids = {c["id"] for c in m.get("tool_calls") or []}
        j += 1
        while ids and j < len(msgs) and msgs[j].get("role") == "tool":
            if msgs[j].get("tool_call_id") not in ids:
                return True
            ids.discard(msgs[j]["tool_call_id"])
            j += 1
        if ids:
            return True
    return False


def floor_tokens(d: Decision) -> int:
    assert d.conv is not None
    cur = current_turn_start(d.conv)
    cur = d.conv.n_messages if cur is None else cur
    return d.overhead_tokens() + sum(d.message_tokens(i) for i in d.conv.fixed) + sum(
        d.message_tokens(i) for i in range(cur, d.conv.n_messages) if i not in d.conv.fixed)


def evaluate(payloads: list[bytes], side: list[dict[str, Any]], budget: int,
             eviction: dict[str, Any], retention: Any) -> dict[str, float]:
    rules = build_rules({
        "memory": {"enable_eviction": True,
                   "budget": {"max_tokens": budget, "max_chars": None, "max_messages": None,
                              "max_turns": None},
                   "eviction": eviction},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
    tok = Tokenizers(200_000)
    req_kept = req_all = tool_kept = tool_all = 0
    macro = 0.0
    n_macro = n_invalid = n_over = n_floor_over = n_evicted = 0
    fwd_tokens = 0
    for raw, s in zip(payloads, side, strict=True):
        body = orjson.loads(raw)
        d = decide(raw, body, rules, tok)
        assert d.plan is not None and d.conv is not None
        fwd = orjson.loads(d.forward)
        hay = retention.request_haystack(fwd)
        evid = s["evidence_texts"]
        evid = json.loads(evid) if isinstance(evid, str) else evid
        req_all += len(evid)
        req_kept += sum(retention.norm(e) in hay for e in evid)
        units = [u for m in body["messages"] if m.get("role") == "tool"
                 for u in leaves(m.get("content"))]
        kept = sum(retention.norm(u) in hay for u in units)
        tool_all += len(units)
        tool_kept += kept
        if units:
            macro += kept / len(units)
            n_macro += 1
        n_invalid += invalid(fwd["messages"])
        tokens = d.kept_tokens()
        fwd_tokens += tokens
        n_evicted += bool(d.plan.dropped)
        floor = floor_tokens(d)
        n_over += tokens - floor > budget
        n_floor_over += floor > budget
    n = len(payloads)
    return {"requests": req_kept / max(1, req_all), "tool_micro": tool_kept / max(1, tool_all),
            "tool_macro": macro / max(1, n_macro), "invalid": n_invalid, "over": n_over,
            "floor_over": n_floor_over, "evicted": n_evicted, "fwd_tokens": fwd_tokens / n,
            "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", type=Path, default=default_data_dir())
    ap.add_argument("--budget", type=int, default=4000)
    ap.add_argument("--set", default="long_context", choices=("long_context", "base"))
    args = ap.parse_args()
    require("--data", args.data / "retention.py",
            args.data / "bfcl" / f"{args.set}_payloads.jsonl",
            args.data / "bfcl" / f"{args.set}_side.jsonl")
    sys.path.insert(0, str(args.data))
    import retention  # the data set's own matching rule (norm, request_haystack)

    bfcl = args.data / "bfcl"
    payloads = (bfcl / f"{args.set}_payloads.jsonl").read_bytes().splitlines()
    side = [json.loads(x) for x in (bfcl / f"{args.set}_side.jsonl").read_text().splitlines()]
    print(f"BFCL {args.set}, {len(payloads)} payloads, budget {args.budget} tokens")
    print("| policy | earlier user requests kept | tool content kept (micro / macro) |"
          " invalid | history over budget | floor over budget | evicted | fwd tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, eviction in POLICIES:
        r = evaluate(payloads, side, args.budget, eviction, retention)
        print(f"| {name} | {r['requests']:.1%} | {r['tool_micro']:.1%} / {r['tool_macro']:.1%} |"
              f" {r['invalid']} | {r['over']} | {r['floor_over']} | {r['evicted']} |"
              f" {r['fwd_tokens']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
