"""What eviction keeps of agent traffic: BFCL long-context payloads through `decide`.

    python -m tests.perf.eval_bfcl_compact [--payloads PATH] [--budget 4000]

Per configuration (drop_unit turn / group, with and without compact_tools), over the
history before each payload's current turn:
- requests kept: earlier user messages still forwarded (their text a substring of it);
- tool content kept: of each tool result, its JSON string/number leaves (or non-empty
  lines when it is not JSON) still substrings of the forwarded request's texts (or of
  a forwarded result's own leaves: JSON escapes decoded), as a
  share per result, averaged over results (a sum would be one 3,000-number list);
- invalid: forwarded requests that break a tool call/result pair, do not start with a
  user message after the system part, or are not an ordered subsequence of the
  original (a compacted tool result counts as its original) but for the recalled
  history moved, in its own order, after the stable part;
- over: requests over the budget although system + tools + current turn fit.

With --sessions: each conversation replayed as a growing session (a request at every
point the model answers, resending the history so far, tools first), bytes sent and
bytes outside the prefix shared with the session's previous request, cost = uncached
+ 0.1 x cached, in millions of tokens at 4 bytes a token (a proxy: no tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from gateway.chat import current_turn_start, decide
from gateway.policy.compact import MARK
from gateway.rules import build_rules
from gateway.tokens import Tokenizers

if __package__ in (None, ""):  # run as a file (python tests/perf/X.py): the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # makes tests importable

from tests.perf.shared_data import default_data_dir, require

ROOT = Path(__file__).resolve().parents[2]
DATA = default_data_dir() / "bfcl" / "long_context_payloads.jsonl"


def leaves(text: str) -> list[str]:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict | list):
        return [ln.strip() for ln in text.splitlines() if ln.strip()]
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str) and v:
            out.append(v)
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out.append(orjson.dumps(v).decode())
    return out


def texts(messages: list[Any]) -> str:
    """The forwarded texts, and the leaves of each forwarded tool result as the model
    reads them: a result kept whole whose JSON escapes a character ("\\u2019", "\\n")
    holds that leaf, though not as a substring of its JSON text."""
    out = []
    for m in messages:
        if isinstance(m.get("content"), str):
            out.append(m["content"])
            if m.get("role") == "tool":
                out.extend(leaves(m["content"]))
        for c in m.get("tool_calls") or ():
            out.append(c["function"]["arguments"])
    return "\n".join(out)


def compacted(orig: dict[str, Any], m: dict[str, Any]) -> bool:
    """m is orig's tool result compacted: marked, or the same JSON minified."""
    if m.get("role") != "tool" or {**orig, "content": None} != {**m, "content": None}:
        return False
    if MARK in m["content"]:
        return True
    try:
        return bool(orjson.loads(m["content"]) == orjson.loads(orig["content"]))
    except orjson.JSONDecodeError:
        return False


def valid(orig: list[Any], sent: list[Any]) -> bool:
    """Every sent item is a distinct original one (a compacted result matches its
    original) in the original order, but for one move: the recalled history, itself in
    order, forwarded after the stable part and before the current turn (one descent of
    the original positions, at most); the first item after the system part is a user
    message; every call answered and every result right after its call."""
    at: list[int] = []
    used: set[int] = set()
    for m in sent:
        j = next((j for j, o in enumerate(orig) if j not in used
                  and (o == m or compacted(o, m))), None)
        if j is None:
            return False
        used.add(j)
        at.append(j)
    if sum(b < a for a, b in zip(at, at[1:])) > 1:
        return False
    rest = [m for m in sent if m["role"] != "system"]
    if not rest or rest[0]["role"] != "user":
        return False
    calls = {c["id"] for m in sent for c in m.get("tool_calls") or ()}
    answered = {m["tool_call_id"] for m in sent if m["role"] == "tool"}
    if calls != answered:
        return False
    pending: set[str] = set()
    for m in sent:  # results come right after their call's assistant message
        if m["role"] == "tool":
            if m["tool_call_id"] not in pending:
                return False
            pending.discard(m["tool_call_id"])
        else:
            if pending:
                return False
            pending = {c["id"] for c in m.get("tool_calls") or ()}
    return not pending


def config(drop_unit: str, compact: bool, budget: int,
           knobs: dict[str, Any] | None = None) -> Any:
    order = ["pinned", "recent_turns"] + (["compact_tools"] if compact else []) + ["length"]
    return build_rules({
        "memory": {"enable_eviction": True,
                   "budget": {"max_tokens": budget, "max_chars": None, "max_messages": None,
                              "max_turns": None},
                   "eviction": {"drop_unit": drop_unit, "order": order,
                                "compact": knobs or {}}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)


def run(lines: list[bytes], drop_unit: str, compact: bool, budget: int,
        knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    rules, tok = config(drop_unit, compact, budget, knobs), Tokenizers(500_000)
    req = req_kept = results = invalid = over = compacted = saved = 0
    share = 0.0
    sent_tokens = 0
    for line in lines:
        body = orjson.loads(line)
        d = decide(line, body, rules, tok)
        out = orjson.loads(d.forward)["messages"]
        start = current_turn_start(d.conv) or len(body["messages"])
        earlier = body["messages"][:start]
        forwarded = texts(out)
        users = [m["content"] for m in earlier if m["role"] == "user"]
        req += len(users)
        req_kept += sum(u in forwarded for u in users)
        for m in earlier:
            if m["role"] == "tool":
                ls = leaves(m["content"])
                if ls:
                    results += 1
                    share += sum(x in forwarded for x in ls) / len(ls)
        invalid += not valid(body["messages"], out)
        if d.plan is not None:
            over += d.plan.over_budget
            sent_tokens += d.kept_tokens()
            n, t = d.compacted_kept()
            compacted, saved = compacted + n, saved + t
    n = len(lines)
    return {"drop_unit": drop_unit, "compact": compact, "requests_kept": req_kept / req,
            "tool_content_kept": share / results, "invalid": invalid, "over_budget": over,
            "mean_tokens": sent_tokens / n, "compacted": compacted, "saved_tokens": saved}


def _common(a: bytes, b: bytes) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the longest common prefix, by bisection
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def sessions(lines: list[bytes], budget: int, knobs: dict[str, Any]) -> None:
    cases = [("no eviction", None), ("turn", config("turn", False, budget)),
             ("turn+compact", config("turn", True, budget, knobs)),
             ("group", config("group", False, budget)),
             ("group+compact", config("group", True, budget, knobs))]
    for name, rules in cases:
        tok, sent, uncached = Tokenizers(500_000), 0, 0
        for line in lines:
            body = orjson.loads(line)
            msgs, prev = body["messages"], b""
            for k in range(2, len(msgs) + 1):
                if msgs[k - 1]["role"] == "assistant":
                    continue  # a request goes when the model is to answer
                b = {"model": body["model"], "tools": body["tools"], "messages": msgs[:k]}
                raw = orjson.dumps(b)
                fwd = raw if rules is None else decide(raw, b, rules, tok).forward
                sent += len(fwd)
                uncached += len(fwd) - _common(prev, fwd)
                prev = fwd
        print(f"{name:14} sent {sent / 4e6:5.2f}M uncached {uncached / 4e6:5.2f}M "
              f"cost {(uncached + 0.1 * (sent - uncached)) / 4e6:5.2f}M")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--payloads", type=Path, default=DATA)
    ap.add_argument("--budget", type=int, default=4000)
    ap.add_argument("--compact", default="{}", help='knobs, e.g. {"min_chars": 1000}')
    ap.add_argument("--sessions", action="store_true", help="growing sessions' cost")
    a = ap.parse_args()
    require("--payloads", a.payloads)
    knobs = orjson.loads(a.compact)
    if a.sessions:
        sessions(a.payloads.read_bytes().splitlines(), a.budget, knobs)
        return
    lines = a.payloads.read_bytes().splitlines()
    print(f"{len(lines)} payloads, budget {a.budget} tokens")
    print(f"{'drop_unit':9} {'compact':7} {'requests':>8} {'tools':>6} {'invalid':>7} "
          f"{'over':>4} {'tokens':>6} {'compacted':>9} {'saved':>7}")
    for unit in ("turn", "group"):
        for compact in (False, True):
            r = run(lines, unit, compact, a.budget, knobs)
            print(f"{unit:9} {compact!s:7} {r['requests_kept']:8.1%} "
                  f"{r['tool_content_kept']:6.1%} {r['invalid']:7} {r['over_budget']:4} "
                  f"{r['mean_tokens']:6.0f} {r['compacted']:9} {r['saved_tokens']:7}")


if __name__ == "__main__":
    main()
