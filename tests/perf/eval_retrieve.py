"""What memgate's retrieval tool keeps within reach of agent traffic, and what it costs:
BFCL long-context conversations through `decide` with memory.retrieve.

    python -m tests.perf.eval_retrieve [--payloads PATH] [--side PATH] [--budget 4000]
        [--reach] [--sessions] [--config NAME=JSON ...] [--sample N] [--output-price 5]

Every configuration is rules/gateway.yaml with eviction on, `--budget` history tokens and
the JSON merged into its `memory` section (e.g. '{"retrieve": {"enabled": true,
"excerpt_min_chars": 8000}, "eviction": {"compact": {"min_chars": 1000}}}').

--reach (each payload once, as `decide` forwards it): every value (eval_bfcl_compact's
`leaves`: JSON string/number leaves, else non-empty lines) of every tool result in the
history is forwarded (in the forwarded texts), reachable (not forwarded, but in the text
`resolve` gives for a cmp-/hist- handle the forwarded body names, and the body carries
the retrieval tool) or neither; "past rounds": reachable values the model can only read
after more than max_rounds parts of max_result_chars. Earlier user requests kept: the
side file's evidence texts, the data set's own rule (retention.py, as eval_bfcl).

--sessions (each conversation replayed as a growing session, eval_bfcl_compact's
requests, the session's history cache in hand as on the server: the tool stays once
added): Anthropic prompt-caching prices in input-token units. A request reads from cache
the part it shares with the session's previous one (x0.1; tools first: a changed tool
list shares nothing) and writes the rest (x1.25: the client's breakpoint ends the
request). Output: the ground truth's next assistant message (x --output-price; an
end-of-turn answer, which BFCL does not hold, as none). The agent is simulated from the
ground truth: the values of the next call's arguments (the next assistant message, or
the side file's expected calls after the last request) that are not in the forwarded
texts but behind a handle the forwarded body names cost retrieval rounds. Each handle
needed is called in parallel, part after part (max_result_chars each, the fewest parts
over the handles holding the value) for up to max_rounds rounds; round r resends the
request (its prefix read from cache, x0.1) and every call and result so far (after the
client's breakpoint: uncached, x1), and its calls are output (the tool's `query` is not
used: which words a model would ask for is not in the data). "lost": values in the
original request that are neither forwarded nor within max_rounds of retrieval. "tool
values": --reach's measure at every request of every session (a value counted once per
request that resends it).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.decide.chat import decide
from gateway.decide.history import HistoryCache
from gateway.decide.retrieve import page, resolve
from gateway.measure.tokens import Tokenizers
from gateway.wire.openai_chat import OPENAI_CHAT

if __package__ in (None, ""):  # run as a file: the checkout makes tests importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.perf.bench_memory import shipped_config
from tests.perf.eval_bfcl_compact import _tokens, leaves, texts
from tests.perf.shared_data import default_data_dir, require

ROOT = Path(__file__).resolve().parents[2]
BFCL = default_data_dir() / "bfcl"
HANDLE = re.compile(rb"(?:cmp|hist)-[0-9a-f]{16,64}")
READ, WRITE = 0.1, 1.25  # Anthropic: cache reads and writes, per input token


def _on(current: int | None = None, pages: int | None = None, **compact: int
        ) -> dict[str, Any]:
    """memory overrides: retrieve on, `current` its excerpt_min_chars, `pages` its
    max_result_chars, `compact` memory.eviction.compact keys."""
    out: dict[str, Any] = {"retrieve": {"enabled": True, "excerpt_min_chars": current}}
    if pages is not None:
        out["retrieve"]["max_result_chars"] = pages
    if compact:
        out["eviction"] = {"compact": compact}
    return out


CONFIGS: list[tuple[str, dict[str, Any] | None]] = [
    ("no eviction", None),
    ("today (retrieve off)", {}),
    ("retrieve on", _on()),
    ("on, current 20000", _on(20000)),
    ("on, current 8000", _on(8000)),
    ("on, current 7000", _on(7000)),
    ("on, current 6000", _on(6000)),
    ("on, current 4000", _on(4000)),
    ("on, compact 1000/600", _on(min_chars=1000, target_chars=600)),
    ("on, compact 1000/600, current 4000", _on(4000, min_chars=1000, target_chars=600)),
    ("on, compact 500/300 keep_recent 0, current 2000",
     _on(2000, min_chars=500, target_chars=300, keep_recent=0)),
    ("on, current 6000, max_result_chars 24000", _on(6000, 24000)),
]


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def rules_for(budget: int, memory: dict[str, Any]) -> Any:
    """rules/gateway.yaml, eviction on at `budget` history tokens, `memory` merged in."""
    data = shipped_config()
    data["memory"] = merged(data["memory"], {"enable_eviction": True,
                                             "budget": {"max_tokens": budget}, **memory})
    return build_rules(data, base_dir=ROOT / "rules")


def variants(x: str) -> tuple[str, ...]:
    """x as a text may hold it: itself, or JSON-escaped (a result quoted in a transcript
    or a marker's excerpt)."""
    return tuple(dict.fromkeys((x, json.dumps(x)[1:-1], json.dumps(x, ensure_ascii=False)[1:-1])))


def holds(hay: str, x: str) -> bool:
    return any(v in hay for v in variants(x))


def parts_to(text: str, x: str, limit: int) -> int | None:
    """How many parts of `limit` characters the model reads of `text` to see x whole
    (None: not in it)."""
    ends = [k + len(v) for v in variants(x) if (k := text.find(v)) >= 0]
    return None if not ends else (min(ends) - 1) // limit + 1


def behind(d: Any, rules: Any, fwd: dict[str, Any]) -> tuple[dict[str, str], dict[str, int]]:
    """(handle -> its text, for the handles the forwarded body names when it carries the
    tool; counts of handles named without the tool and of handles `resolve` does not
    know)."""
    found = {h.decode() for h in HANDLE.findall(d.forward)}
    tool = rules.memory.retrieve.tool_name
    names = {(t.get("function") or {}).get("name") for t in fwd.get("tools") or ()}
    out, bad = {}, {"no_tool": 0, "unknown": 0}
    for h in sorted(found):
        text = resolve(d, h)
        if tool not in names:
            bad["no_tool"] += 1
        elif text is None:
            bad["unknown"] += 1
        else:
            out[h] = text
    return out, bad


def tool_values(msgs: list[dict[str, Any]], hay: str, hidden: dict[str, str],
                r: Any) -> dict[str, int]:
    """Where the values of the tool results in `msgs` are: forwarded (in `hay`), reachable
    (behind a handle: `hidden`; past_rounds: only after more than max_rounds parts) or
    neither."""
    n = {"values": 0, "forwarded": 0, "reachable": 0, "neither": 0, "past_rounds": 0}
    for m in msgs:
        if m["role"] != "tool":
            continue
        for x in leaves(m["content"]):
            n["values"] += 1
            if holds(hay, x):
                n["forwarded"] += 1
                continue
            parts = [p for t in hidden.values() if (p := parts_to(t, x, r.max_result_chars))]
            if parts:
                n["reachable"] += 1
                n["past_rounds"] += min(parts) > r.max_rounds
            else:
                n["neither"] += 1
    return n


def reach(lines: list[bytes], side: list[dict[str, Any]], rules: Any,
          retention: Any) -> dict[str, Any]:
    """Part A: where each tool result value of each payload's history is."""
    tok = Tokenizers(500_000)
    r = rules.memory.retrieve
    n = {"values": 0, "forwarded": 0, "reachable": 0, "neither": 0, "past_rounds": 0,
         "req": 0, "req_kept": 0, "no_tool": 0, "unknown": 0, "tool_on": 0}
    for i, (line, s) in enumerate(zip(lines, side, strict=True)):
        body = orjson.loads(line)
        d = decide(line, body, rules, tok, key=("eval", f"p{i}"))
        fwd = orjson.loads(d.forward)
        hay = texts(fwd["messages"])
        hidden, bad = behind(d, rules, fwd)
        n["no_tool"] += bad["no_tool"]
        n["unknown"] += bad["unknown"]
        n["tool_on"] += d.retrieve is not None
        for k, v in tool_values(body["messages"], hay, hidden, r).items():
            n[k] += v
        evid = s["evidence_texts"]
        evid = json.loads(evid) if isinstance(evid, str) else evid
        stack = retention.request_haystack(fwd)
        n["req"] += len(evid)
        n["req_kept"] += sum(retention.norm(e) in stack for e in evid)
    return n


def expected_message(calls: list[str]) -> dict[str, Any]:
    """The side file's expected calls ("f(a='x')") as the assistant message making them."""
    out = []
    for k, call in enumerate(calls):
        node = ast.parse(call, mode="eval").body
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), call
        args: dict[str, Any] = {f"_{j}": ast.literal_eval(a) for j, a in enumerate(node.args)}
        args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg})
        out.append({"id": f"expected_{k}", "type": "function",
                    "function": {"name": node.func.id, "arguments": json.dumps(args)}})
    return {"role": "assistant", "content": None, "tool_calls": out}


def call_values(msg: dict[str, Any]) -> list[str]:
    """The distinct values (string/number leaves) of an assistant message's call arguments."""
    out: list[str] = []
    for c in msg.get("tool_calls") or ():
        out += leaves(c["function"]["arguments"])
    return list(dict.fromkeys(x for x in out if x.strip()))


def retrieval(hidden: dict[str, str], needed: dict[str, tuple[str, int]], rules: Any,
              counter: Any) -> tuple[list[int], list[int], int]:
    """The rounds that fetch `needed` (value -> (handle, parts)): per round, the tokens it
    appends (the model's calls and memgate's results) and the tokens of its calls;
    and how many values stay out of reach (more parts than max_rounds)."""
    r = rules.memory.retrieve
    want: dict[str, int] = {}
    for h, p in needed.values():
        want[h] = max(want.get(h, 0), p)
    rounds = min(r.max_rounds, max(want.values(), default=0))
    appended, calls = [], []
    for k in range(rounds):
        hs = [h for h, p in want.items() if p > k]
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_r{k}_{j}", "type": "function", "function": {
                "name": r.tool_name, "arguments": json.dumps(
                    {"handle": h, **({"offset": k * r.max_result_chars} if k else {})})}}
            for j, h in enumerate(hs)]}
        results = [{"role": "tool", "tool_call_id": f"call_r{k}_{j}",
                    "content": page(hidden[h], k * r.max_result_chars, r.max_result_chars,
                                    r.tool_name)} for j, h in enumerate(hs)]
        c = OPENAI_CHAT.item_tokens(call, counter)
        calls.append(c)
        appended.append(c + sum(OPENAI_CHAT.item_tokens(m, counter) for m in results))
    return appended, calls, sum(p > r.max_rounds for _, p in needed.values())


def cached(prev: dict[str, Any] | None, fwd: dict[str, Any], over: int, per: list[int]
           ) -> int:
    """The tokens of `fwd` read from the cache the session's previous request `prev`
    wrote: tools first (changed tools share nothing), then the messages they share."""
    if prev is None or prev["tools"] != fwd["tools"]:
        return 0
    pm, fm = prev["messages"], fwd["messages"]
    j = next((j for j, (x, y) in enumerate(zip(pm, fm)) if x != y), min(len(pm), len(fm)))
    return over + sum(per[:j])


def next_call(msgs: list[dict[str, Any]], k: int, s: dict[str, Any]) -> dict[str, Any] | None:
    """The ground truth's answer to the request of msgs[:k]: the next assistant message,
    the side file's expected calls after the last one, None at the end of a turn (BFCL
    holds no answer text)."""
    if k < len(msgs):
        return msgs[k] if msgs[k]["role"] == "assistant" else None
    return expected_message(s["expected_calls"]) if s["expected_calls"] else None


def sessions(lines: list[bytes], side: list[dict[str, Any]], rules: Any | None,
             out_price: float, check_tools: bool = True) -> dict[str, float]:
    """Part B: one configuration's growing sessions, priced (see the module docstring);
    `check_tools`: also where every tool result value of every request is (as --reach)."""
    tok = Tokenizers(500_000)
    counter = tok.get("cl100k_base")
    history = HistoryCache(256 << 20, 10_000)
    limit = rules.memory.retrieve.max_result_chars if rules is not None else 0
    n = dict.fromkeys(("requests", "read", "written", "round_read", "round_uncached",
                       "output", "rounds", "with_round", "fetched", "lost", "lost_rounds",
                       "no_tool", "unknown", "tool_neither", "tool_past_rounds"), 0.0)
    n["sessions"] = len(lines)
    for i, (line, s) in enumerate(zip(lines, side, strict=True)):
        body = orjson.loads(line)
        msgs = body["messages"]
        prev: dict[str, Any] | None = None
        hidden: dict[str, str]
        for k in range(2, len(msgs) + 1):
            if msgs[k - 1]["role"] == "assistant":
                continue  # a request goes when the model is to answer
            b = {"model": body["model"], "tools": body["tools"], "messages": msgs[:k]}
            fwd, hidden = b, {}
            if rules is not None:
                d = decide(orjson.dumps(b), b, rules, tok, history=history,
                           key=("eval", f"s{i}"))
                fwd = orjson.loads(d.forward)
                hidden, bad = behind(d, rules, fwd)
                n["no_tool"] += bad["no_tool"]
                n["unknown"] += bad["unknown"]
            hay = texts(fwd["messages"])
            if rules is not None and check_tools:
                got = tool_values(msgs[:k], hay, hidden, rules.memory.retrieve)
                n["tool_neither"] += got["neither"]
                n["tool_past_rounds"] += got["past_rounds"]
            over, per = _tokens(fwd, counter)
            total = over + sum(per)
            read = cached(prev, fwd, over, per)
            n["read"] += read
            n["written"] += total - read
            n["requests"] += 1
            prev = fwd
            gt = next_call(msgs, k, s)
            if gt is None:
                continue
            n["output"] += OPENAI_CHAT.item_tokens(gt, counter)
            origin = texts(b["messages"]) if rules is not None else hay
            needed: dict[str, tuple[str, int]] = {}
            for x in call_values(gt):
                if holds(hay, x) or not holds(origin, x):
                    continue  # forwarded, or not from the context (the model's own)
                where = [(p, h) for h, t in hidden.items() if (p := parts_to(t, x, limit))]
                if where:
                    p, h = min(where)
                    needed[x] = (h, p)
                else:
                    n["lost"] += 1
            if needed:
                assert rules is not None
                appended, calls, short = retrieval(hidden, needed, rules, counter)
                n["fetched"] += len(needed) - short
                n["lost_rounds"] += short
                n["rounds"] += len(appended)
                n["with_round"] += 1
                n["round_read"] += total * len(appended)
                n["round_uncached"] += sum(sum(appended[:r + 1]) for r in range(len(appended)))
                n["output"] += sum(calls)
    n["cost"] = (READ * (n["read"] + n["round_read"]) + WRITE * n["written"]
                 + n["round_uncached"] + out_price * n["output"])
    return n


def sample(lines: list[Any], every: int) -> list[Any]:
    return lines[::every] if every > 1 else lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payloads", type=Path, default=BFCL / "long_context_payloads.jsonl")
    ap.add_argument("--side", type=Path, default=BFCL / "long_context_side.jsonl")
    ap.add_argument("--budget", type=int, default=4000)
    ap.add_argument("--reach", action="store_true", help="part A: what stays reachable")
    ap.add_argument("--sessions", action="store_true", help="part B: growing sessions' cost")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON",
                    help="a configuration (memory overrides) instead of the default list")
    ap.add_argument("--sample", type=int, default=1, metavar="N",
                    help="every Nth conversation only")
    ap.add_argument("--output-price", type=float, default=5.0,
                    help="an output token in input tokens (Anthropic: 5)")
    a = ap.parse_args()
    require("--payloads", a.payloads, a.side)
    lines = sample(a.payloads.read_bytes().splitlines(), a.sample)
    side = sample([json.loads(x) for x in a.side.read_text().splitlines()], a.sample)
    configs = CONFIGS
    if a.config:
        configs = [CONFIGS[0]] + [(c.split("=", 1)[0], json.loads(c.split("=", 1)[1]))
                                  for c in a.config]
    if not (a.reach or a.sessions):
        a.reach = a.sessions = True
    if a.reach:
        print_reach(lines, side, configs, a.budget)
    if a.sessions:
        print_sessions(lines, side, configs, a.budget, a.output_price)


def print_reach(lines: list[bytes], side: list[dict[str, Any]],
                configs: list[tuple[str, dict[str, Any] | None]], budget: int) -> None:
    data = default_data_dir()
    require("MEMGATE_DATA", data / "retention.py")
    sys.path.insert(0, str(data))
    import retention  # type: ignore[import-not-found]  # the data set's own matching rule

    print(f"A. reachability: {len(lines)} payloads, budget {budget} tokens")
    print("| configuration | values forwarded | reachable | neither | past max_rounds |"
          " earlier user requests kept | tool carried | handles without the tool |"
          " handles unknown |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, memory in configs:
        if memory is None:
            continue
        n = reach(lines, side, rules_for(budget, memory), retention)
        v = n["values"]
        print(f"| {name} | {n['forwarded'] / v:.1%} | {n['reachable'] / v:.1%} |"
              f" {n['neither']} ({n['neither'] / v:.1%}) | {n['past_rounds']} |"
              f" {n['req_kept'] / n['req']:.1%} | {n['tool_on']} | {n['no_tool']} |"
              f" {n['unknown']} |", flush=True)


def print_sessions(lines: list[bytes], side: list[dict[str, Any]],
                   configs: list[tuple[str, dict[str, Any] | None]], budget: int,
                   out_price: float) -> None:
    print(f"\nB. growing sessions: {len(lines)} conversations, budget {budget} tokens; cost ="
          f" 0.1 x read + 1.25 x written + 1 x uncached + {out_price:g} x output (millions"
          " of input-token units); call values: the next call's argument values not"
          " forwarded; tool values: of every request's tool results")
    print("| configuration | cost | vs no eviction | read / written / rounds' uncached /"
          " output (M tokens) | rounds per session | requests needing a round |"
          " call values fetched | call values lost (none behind a handle / past"
          " max_rounds) | tool values neither / past max_rounds | handles without the tool"
          " / unknown |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for name, memory in configs:
        rules = None if memory is None else rules_for(budget, memory)
        n = sessions(lines, side, rules, out_price)
        base = base or n["cost"]
        m = {k: n[k] / 1e6 for k in ("read", "written", "round_uncached", "output")}
        print(f"| {name} | {n['cost'] / 1e6:.3f} | {n['cost'] / base:.1%} |"
              f" {m['read'] + n['round_read'] / 1e6:.2f} / {m['written']:.3f} /"
              f" {m['round_uncached']:.3f} / {m['output']:.3f} |"
              f" {n['rounds'] / n['sessions']:.2f} | {n['with_round']:.0f} / {n['requests']:.0f} |"
              f" {n['fetched']:.0f} | {n['lost']:.0f} / {n['lost_rounds']:.0f} |"
              f" {n['tool_neither']:.0f} / {n['tool_past_rounds']:.0f} |"
              f" {n['no_tool']:.0f} / {n['unknown']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
