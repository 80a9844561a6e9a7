"""What eviction keeps of agent traffic: BFCL long-context payloads through `decide`.

    python -m tests.perf.eval_bfcl_compact [--payloads PATH] [--budget 4000]
        [--compact JSON] [--oracle | --sessions]

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
"lines" is the line-level variant of the tool measure (`line_leaves`): a multi-line
string leaf counts as its lines. Both are printed; neither replaces the other.

With --oracle: upper bounds of both measures at the budget (see `oracle`), and the
payloads whose earlier requests cannot all fit beside the floor.

With --sessions: each conversation replayed as a growing session (a request at every
point the model is to answer, resending the history so far, tools first): tokens sent
(the gateway's counter), tokens outside the messages shared with the session's previous
request ("uncached"), cost = uncached + 0.1 x cached, against no eviction, and the lower
bound no policy beats (see `sessions`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import SECTIONS, build_rules
from gateway.decide.chat import decide
from gateway.decide.decision import current_turn_start
from gateway.measure.tokens import Tokenizers
from gateway.policy.compact import MARK
from gateway.wire.openai_chat import OPENAI_CHAT

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


def line_leaves(text: str) -> list[str]:
    """The line-level variant of the measure: `leaves`, with each multi-line string leaf
    (a file, a diff inside the JSON) split into its non-empty lines, so an excerpt that
    keeps most lines of it is not scored as if it kept nothing."""
    out: list[str] = []
    for x in leaves(text):
        if "\n" in x:
            out.extend(ln.strip() for ln in x.splitlines() if ln.strip())
        else:
            out.append(x)
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


CONFIG_KEYS = frozenset(SECTIONS["memory.eviction.compact"])
EVICTION_KEYS = frozenset({"low_water", "recall_share"})


def config(drop_unit: str, compact: bool, budget: int,
           knobs: dict[str, Any] | None = None) -> Any:
    """The rules of one configuration. `knobs`: keys of memory.eviction.compact (and
    low_water / recall_share); any other CompactRules field is set on the parsed rules
    (an experiment's knob, not a config key)."""
    knobs = knobs or {}
    order = ["pinned", "recent_turns"] + (["compact_tools"] if compact else []) + ["length"]
    rules = build_rules({
        "memory": {"enable_eviction": True,
                   "budget": {"max_tokens": budget, "max_chars": None, "max_messages": None,
                              "max_turns": None},
                   "eviction": {"drop_unit": drop_unit, "order": order,
                                **{k: v for k, v in knobs.items() if k in EVICTION_KEYS},
                                "compact": {k: v for k, v in knobs.items()
                                            if k in CONFIG_KEYS}}},
        "tokens": {"models_file": "rules/models.yaml"}}, base_dir=ROOT)
    extra = {k: v for k, v in knobs.items() if k not in CONFIG_KEYS | EVICTION_KEYS}
    if extra:
        ev = rules.memory.eviction
        ev = replace(ev, compact=replace(ev.compact, **extra))
        rules = replace(rules, memory=replace(rules.memory, eviction=ev))
    return rules


def run(lines: list[bytes], drop_unit: str, compact: bool, budget: int,
        knobs: dict[str, Any] | None = None) -> dict[str, Any]:
    rules, tok = config(drop_unit, compact, budget, knobs), Tokenizers(500_000)
    req = req_kept = results = invalid = over = compacted = saved = 0
    share = line_share = 0.0
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
                    lls = line_leaves(m["content"])
                    line_share += sum(x in forwarded for x in lls) / len(lls)
        invalid += not valid(body["messages"], out)
        if d.plan is not None:
            over += d.plan.over_budget
            sent_tokens += d.kept_tokens()
            n, t = d.compacted_kept()
            compacted, saved = compacted + n, saved + t
    n = len(lines)
    return {"drop_unit": drop_unit, "compact": compact, "requests_kept": req_kept / req,
            "tool_content_kept": share / results, "tool_lines_kept": line_share / results,
            "invalid": invalid, "over_budget": over,
            "mean_tokens": sent_tokens / n, "compacted": compacted, "saved_tokens": saved}


def _hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper concave hull from (0, 0) of (cost, value) points of rising cost, as
    segments (cost, value): the LP relaxation of keeping a prefix of them."""
    segs: list[tuple[float, float]] = []
    cx = cy = 0.0
    while points:
        k = max(range(len(points)),
                key=lambda j: (points[j][1] - cy) / max(1e-9, points[j][0] - cx))
        x, y = points[k]
        if y <= cy:
            break
        segs.append((x - cx, y - cy))
        cx, cy, points = x, y, points[k + 1:]
    return segs


def oracle(line: bytes, rules: Any, tok: Tokenizers, budget: int, unit: Any = leaves,
           structure: bool = True, requests_first: bool = True) -> dict[str, Any]:
    """An upper bound of what any policy keeps of one payload at `budget`, scored as
    `run` scores it. Room = budget - floor (tools, system, current turn: the gateway's
    counts). Requests first (cheapest first: a request is kept whole or not at all),
    then tool content as a fractional knapsack over leaves, each costing its own tokens,
    optimistic everywhere: a leaf that is a substring of the floor, of a kept request or
    of another leaf is free, a leaf in k results costs 1/k in each, and (structure) a
    result's first kept leaf pays its message's wrapper and its call's assistant
    message shared among that message's calls (pairs stay whole), else nothing."""
    body = orjson.loads(line)
    d = decide(line, body, rules, tok)
    assert d.conv is not None
    msgs = body["messages"]
    start = current_turn_start(d.conv) or len(msgs)
    count = d.counter.count
    floor = d.overhead_tokens() + sum(d.message_tokens(i) for i in d.conv.fixed
                                      if i < start)
    floor += sum(d.message_tokens(i) for i in range(start, len(msgs)))
    free = [m["content"] for i, m in enumerate(msgs) if isinstance(m.get("content"), str)
            and (i >= start or m["role"] == "system")]
    room = budget - floor
    users = sorted((d.message_tokens(i), m["content"]) for i, m in enumerate(msgs[:start])
                   if m["role"] == "user")
    kept_users = 0
    for cost, text in users if requests_first else ():
        if cost <= room:
            room -= cost
            kept_users += 1
            free.append(text)
    hay = "\n".join(free)
    results: list[tuple[list[str], float]] = []
    owner, calls = 0, 1
    for i, m in enumerate(msgs[:start]):
        if m["role"] == "assistant":
            owner, calls = i, max(1, len(m.get("tool_calls") or ()))
        elif m["role"] == "tool" and (ls := unit(m["content"])):
            wrap = d.message_tokens(i) - count(m["content"])
            results.append((ls, wrap + d.message_tokens(owner) / calls if structure else 0))
    distinct = {x for ls, _ in results for x in ls}
    joined = "\0".join(distinct)
    freebie = {x for x in distinct if x in hay or joined.count(x) > 1}
    occurs: dict[str, int] = {}
    for ls, _ in results:
        for x in set(ls):
            occurs[x] = occurs.get(x, 0) + 1
    got = 0.0
    segs: list[tuple[float, float]] = []
    for ls, fixed in results:
        v = 1 / len(ls)
        got += v * sum(x in freebie for x in ls)
        costs = sorted(max(1, count(x)) / occurs[x] for x in ls if x not in freebie)
        points, c, val = [], fixed, 0.0
        for x in costs:
            c, val = c + x, val + v
            points.append((c, val))
        segs.extend(_hull(points))
    segs.sort(key=lambda sv: -sv[1] / sv[0])
    for c, val in segs:
        if room <= 0:
            break
        take = min(1.0, room / c)
        got, room = got + val * take, room - c * take
    return {"floor": floor, "room": budget - floor, "requests": len(users),
            "requests_kept": kept_users, "results": len(results), "tool_kept": got}


def print_oracle(lines: list[bytes], budget: int) -> None:
    rules, tok = config("turn", False, budget), Tokenizers(500_000)
    print(f"upper bounds at {budget} tokens ({len(lines)} payloads)")
    print("| tool unit | structure paid | requests first | requests kept | tool content |")
    print("|---|---|---|---|---|")
    short: list[tuple[int, dict[str, Any]]] = []
    for name, unit in (("leaves", leaves), ("lines", line_leaves)):
        for structure in (False, True):
            for first in (True, False):
                rows = [oracle(x, rules, tok, budget, unit, structure, first) for x in lines]
                n_req = sum(r["requests"] for r in rows)
                n_res = sum(r["results"] for r in rows)
                print(f"| {name} | {structure} | {first} | "
                      f"{sum(r['requests_kept'] for r in rows) / n_req:.1%} | "
                      f"{sum(r['tool_kept'] for r in rows) / n_res:.1%} |")
                if name == "leaves" and structure and first:
                    short = [(i, r) for i, r in enumerate(rows)
                             if r["requests_kept"] < r["requests"]]
    print("\npayloads whose earlier requests cannot all fit beside the floor")
    print("| payload | floor | room | earlier requests | fit (cheapest first) |")
    print("|---|---|---|---|---|")
    for i, r in short:
        print(f"| {i} | {r['floor']} | {r['room']} | {r['requests']} | {r['requests_kept']} |")


def _tokens(body: dict[str, Any], counter: Any) -> tuple[int, list[int]]:
    """(tools and reply priming, each message's tokens): the gateway's own counts."""
    return (OPENAI_CHAT.overhead_tokens(body, counter),
            [OPENAI_CHAT.item_tokens(m, counter) for m in body["messages"]])


def session_cases(budget: int, knobs: dict[str, Any]) -> list[tuple[str, Any]]:
    """The configurations replayed: no eviction, today's (shipped order, no compaction)
    and with compaction, per drop unit, and the --compact knobs."""
    return [("no eviction", None),
            ("turn", config("turn", False, budget)),
            ("turn+compact", config("turn", True, budget, knobs)),
            ("group", config("group", False, budget)),
            ("group+compact", config("group", True, budget, knobs))]


def sessions(lines: list[bytes], budget: int, cases: list[tuple[str, Any]]
             ) -> list[dict[str, Any]]:
    """Each case's growing sessions, in tokens (the gateway's counter, per message as the
    planner counts them): sent; uncached, the messages from the first one that differs
    from the session's previous request on (the whole first request of a session: its
    tools too); cost = uncached + 0.1 x cached. Also the lower bound no policy can beat:
    every request sends at least its floor (tools, system, the current user message,
    the messages appended since the previous request) and the
    messages appended since the previous request are never cached, so
    cost >= 0.9 x appended + 0.1 x floor, summed (appended: what no eviction sends
    uncached)."""
    out = []
    for name, rules in cases:
        tok = Tokenizers(500_000)
        counter = tok.get("cl100k_base")
        sent = uncached = floor = appended = requests = 0
        for line in lines:
            body = orjson.loads(line)
            msgs = body["messages"]
            prev: list[Any] | None = None
            prev_orig: list[Any] = []
            for k in range(2, len(msgs) + 1):
                if msgs[k - 1]["role"] == "assistant":
                    continue  # a request goes when the model is to answer
                b = {"model": body["model"], "tools": body["tools"], "messages": msgs[:k]}
                if rules is not None:
                    raw = orjson.dumps(b)
                    fb = orjson.loads(decide(raw, b, rules, tok).forward)
                else:
                    fb = b
                over, per = _tokens(fb, counter)
                fwd = fb["messages"]
                sent += over + sum(per)
                if prev is None:
                    new = over + sum(per)
                else:
                    j = next((j for j, (x, y) in enumerate(zip(prev, fwd)) if x != y),
                             min(len(prev), len(fwd)))
                    new = sum(per[j:])
                uncached += new
                # the floor: tools, system messages, the current user message and what
                # came since the previous request (older results of the current turn may
                # be compacted)
                last_user = max(i for i, m in enumerate(msgs[:k]) if m["role"] == "user")
                o_over, o_per = _tokens(b, counter)
                since = 0 if prev is None else len(prev_orig)
                floor += o_over + sum(t for i, t in enumerate(o_per) if i >= since
                                      or i == last_user or msgs[i]["role"] == "system")
                appended += (o_over + sum(o_per)) if prev is None else sum(o_per[since:])
                prev, prev_orig = fwd, msgs[:k]
                requests += 1
        out.append({"case": name, "requests": requests, "sent": sent, "uncached": uncached,
                    "cost": uncached + 0.1 * (sent - uncached),
                    "bound": 0.9 * appended + 0.1 * floor})
    return out


def print_sessions(rows: list[dict[str, Any]]) -> None:
    base = rows[0]["cost"]
    today = {r["case"]: r["cost"] for r in rows}
    print(f"{rows[0]['requests']} requests; tokens in millions (gateway counter)")
    print("| case | sent | uncached | cost | vs no eviction | vs today (same unit) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ref = today.get(r["case"].split("+")[0], r["cost"])
        print(f"| {r['case']} | {r['sent'] / 1e6:.3f} | {r['uncached'] / 1e6:.3f} | "
              f"{r['cost'] / 1e6:.3f} | {r['cost'] / base:.1%} | {r['cost'] / ref:.1%} |")
    print(f"| lower bound (any policy) | | | {rows[0]['bound'] / 1e6:.3f} | "
          f"{rows[0]['bound'] / base:.1%} | |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--payloads", type=Path, default=DATA)
    ap.add_argument("--budget", type=int, default=4000)
    ap.add_argument("--compact", default="{}", help='knobs, e.g. {"min_chars": 1000}')
    ap.add_argument("--sessions", action="store_true", help="growing sessions' cost")
    ap.add_argument("--oracle", action="store_true", help="upper bounds of what fits")
    a = ap.parse_args()
    require("--payloads", a.payloads)
    knobs = orjson.loads(a.compact)
    if a.oracle:
        print_oracle(a.payloads.read_bytes().splitlines(), a.budget)
        return
    if a.sessions:
        print_sessions(sessions(a.payloads.read_bytes().splitlines(), a.budget,
                                session_cases(a.budget, knobs)))
        return
    lines = a.payloads.read_bytes().splitlines()
    print(f"{len(lines)} payloads, budget {a.budget} tokens")
    print(f"{'drop_unit':9} {'compact':7} {'requests':>8} {'tools':>6} {'lines':>6} "
          f"{'invalid':>7} "
          f"{'over':>4} {'tokens':>6} {'compacted':>9} {'saved':>7}")
    for unit in ("turn", "group"):
        for compact in (False, True):
            r = run(lines, unit, compact, a.budget, knobs)
            print(f"{unit:9} {compact!s:7} {r['requests_kept']:8.1%} "
                  f"{r['tool_content_kept']:6.1%} {r['tool_lines_kept']:6.1%} "
                  f"{r['invalid']:7} {r['over_budget']:4} "
                  f"{r['mean_tokens']:6.0f} {r['compacted']:9} {r['saved_tokens']:7}")


if __name__ == "__main__":
    main()
