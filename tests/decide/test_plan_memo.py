"""The planner's request-path shortcuts only ever save work: a session's requests decided
with planpass, plancache, recallscan and toolscan on give exactly what they give with
them off (MEMGATE_SHORTCUTS_OFF), over generated histories with tool groups, pins, the
recall fill and compaction, in all three wire shapes; and on the warm path they are
taken (the memo hits, the full-budget pass is skipped, the tool-result scan resumes)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.env_overrides import apply_env
from gateway.config.rules import build_rules
from gateway.config.schema import Rules
from gateway.decide.chat import EXACT_CHARS, decide
from gateway.decide.decision import Decision
from gateway.decide.history import HistoryCache
from gateway.errors import GatewayError
from gateway.measure.tokens import Tokenizers
from gateway.policy import STAGES
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT
from gateway.wire.openai_responses import OPENAI_RESPONSES
from tests.strategies import conversation, memory_rules, to_anthropic, to_responses

ROOT = Path(__file__).resolve().parents[2]
PLAN_SHORTCUTS = "planpass,plancache,recallscan,toolscan,exactfit"
WIRES: dict[str, tuple[Wire, Any]] = {
    "chat": (OPENAI_CHAT, lambda msgs: {"model": "gpt-4o-mini", "messages": msgs}),
    "anthropic": (ANTHROPIC_MESSAGES, to_anthropic),
    "responses": (OPENAI_RESPONSES, to_responses),
}


def make_rules(memory: dict[str, Any], off: str = "") -> Rules:
    memory = {**memory, "carry": {"rules_file": "carry.yaml", "log_skipped": False}}
    rules = build_rules({"memory": memory, "tokens": {"models_file": "models.yaml"}},
                        base_dir=ROOT / "rules")
    return apply_env(rules, {"MEMGATE_SHORTCUTS_OFF": off}) if off else rules


def outcome(d: Decision) -> tuple[Any, ...]:
    snap = d.snapshot.fields if d.snapshot is not None else None
    return (d.conv, d.plan, d.forward, snap, d.note, d.skip_reason, d.est_tokens(),
            d.compacted, d.archived)


def decided(raw: bytes, rules: Rules, wire: Wire, cache: HistoryCache, tok: Tokenizers
            ) -> Any:
    try:
        return outcome(decide(raw, orjson.loads(raw), rules, tok, wire, history=cache,
                              key=("tenant", "s1"), archive_in="tenant"))
    except GatewayError as err:
        return ("error", type(err).__name__, str(err))


@st.composite
def session(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A wire and one session's bodies: the conversation growing a turn at a time, and
    after some turns requests that resend the same history with another last question
    (the stable-part memo's case)."""
    name = draw(st.sampled_from(sorted(WIRES)))
    _, to_body = WIRES[name]
    msgs = draw(conversation(max_turns=10))
    for m in msgs:  # some tool results long enough to compact
        if m["role"] == "tool" and draw(st.integers(0, 2)) == 0:
            m["content"] = (m["content"] + " result line 42;") * draw(st.integers(5, 30))
    ends = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    bodies = []
    for end in ends:
        bodies.append(orjson.dumps(to_body(msgs[: end + 1])))
        for k in range(draw(st.integers(0, 2))):
            ask = {"role": "user", "content": draw(st.sampled_from(
                ["and now?", "what about report.csv", f"again {k}", "订单 汇总 上周 " * (k + 1)]))}
            bodies.append(orjson.dumps(to_body([*msgs[:end], ask])))
    return name, bodies


@st.composite
def rules_section(draw: st.DrawFn) -> dict[str, Any]:
    memory = draw(memory_rules())
    if draw(st.booleans()):  # a turn cap that cuts (and old pins it passes over)
        memory["budget"]["max_turns"] = draw(st.integers(1, 4))
    if draw(st.booleans()):  # compaction before the length stage, as shipped
        order = memory["eviction"]["order"]
        order.insert(order.index("length"), "compact_tools")
        memory["eviction"]["compact"] = {"min_chars": 50, "target_chars": 200,
                                         "keep_recent": draw(st.integers(0, 2)),
                                         # the generated calls are all named f
                                         "exclude_tools": draw(st.sampled_from([[], ["f"]]))}
    return memory


@pytest.mark.slow
@given(s=session(), memory=rules_section())
@settings()
def test_plan_shortcuts_change_nothing(s: tuple[str, list[bytes]], memory: dict[str, Any]
                                       ) -> None:
    name, bodies = s
    wire, _ = WIRES[name]
    on, off = make_rules(memory), make_rules(memory, PLAN_SHORTCUTS)
    cache_on, cache_off = HistoryCache(1 << 24, 100), HistoryCache(1 << 24, 100)
    tok_on, tok_off = Tokenizers(50_000), Tokenizers(50_000)
    for raw in bodies:
        assert decided(raw, on, wire, cache_on, tok_on) == decided(raw, off, wire, cache_off,
                                                                   tok_off)


def shipped(off: str = "", max_turns: int | None = None) -> Rules:
    cfg = yaml.safe_load((ROOT / "rules" / "gateway.yaml").read_text(encoding="utf-8"))
    cfg["memory"]["enable_eviction"] = True
    if max_turns is not None:
        cfg["memory"]["budget"]["max_turns"] = max_turns
    rules = build_rules(cfg, base_dir=ROOT / "rules")
    return apply_env(rules, {"MEMGATE_SHORTCUTS_OFF": off}) if off else rules


def agent_history(n: int) -> list[dict[str, Any]]:
    """n messages of tool-using turns, results long enough to compact."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are careful."}]
    t = 0
    while len(msgs) < n:
        t += 1
        msgs += [{"role": "user", "content": f"step {t}: read /src/m{t}.py and fix it"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{t}", "type": "function",
                      "function": {"name": "read_file", "arguments": f'{{"p": "m{t}"}}'}}]},
                 {"role": "tool", "tool_call_id": f"c{t}",
                  "content": f"def f{t}(x):\n    return x\n" * 120},
                 {"role": "assistant", "content": f"fixed m{t}"}]
    return msgs


def counting(monkeypatch: pytest.MonkeyPatch, stages: tuple[str, ...]
             ) -> tuple[list[str], list[int]]:
    """(each run of the named planner stages, the items each tool-result scan reads),
    recorded from now on."""
    calls: list[str] = []
    for name in stages:
        stage = STAGES[name]

        def counted(st: Any, stage: Any = stage, name: str = name) -> None:
            calls.append(name)
            stage(st)

        monkeypatch.setitem(STAGES, name, counted)
    scanned: list[int] = []
    scan = type(OPENAI_CHAT).tool_results

    def counting_scan(self: Any, items: list[Any], start: int = 0,
                      names: dict[Any, str] | None = None) -> Any:
        scanned.append(len(items) - start)
        return scan(self, items, start, names)

    monkeypatch.setattr(type(OPENAI_CHAT), "tool_results", counting_scan)
    return calls, scanned


def test_warm_path_takes_the_shortcuts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shipped rules, eviction on: a request that resends the history with a new question
    gets the stable part from the memo (no stage runs), a grown one skips the
    full-budget pass (the recent-turns cap already drops), the tool-result scan resumes
    from the session's entry; and all of it decides what the long way decides."""
    calls, scanned = counting(monkeypatch, ("length", "pinned"))
    msgs = agent_history(120)
    tok = Tokenizers(50_000)

    def session(rules: Rules) -> list[Any]:
        cache = HistoryCache(1 << 26, 10)
        out = []
        for k, ask in enumerate(["now m7?", "and m9?", "and m9?", "what of m30?"]):
            body = orjson.dumps({"model": "gpt-4o-mini", "messages": [
                *msgs, *agent_history(8 * (k == 3))[1:],
                {"role": "user", "content": ask}]})
            calls.clear()
            scanned.clear()
            d = decide(body, orjson.loads(body), rules, tok, history=cache, key=("t", "s"))
            out.append((outcome(d), dict(Counter(calls)), sum(scanned)))
        return out

    # a turn cap that cuts these 30 turns (the shipped 200 would not)
    fast, slow = session(shipped(max_turns=20)), session(shipped(PLAN_SHORTCUTS, 20))
    assert [o for o, _, _ in fast] == [o for o, _, _ in slow]
    plan = fast[0][0][1]
    assert plan.dropped and plan.recalled and fast[0][0][7]  # cut, recalled, compacted
    # each request plans twice: first whether the history is cut (the stages once, under
    # the whole budget: no fill), then, compact_tools having shortened old results, with
    # the fill; the long way, that plan runs its stages in both passes
    assert all(c == {"pinned": 3, "length": 3} for _, c, _ in slow)
    # there, pinned once for both passes; recent_turns and length in both (the stable
    # part has its share of the turn cap: the full-budget pass cannot be skipped)
    assert fast[0][1] == fast[3][1] == {"pinned": 2, "length": 3}
    # the same history again (twice): the client's history and the compacted one both
    # planned from the memo (the compacted groups are the same objects as last request)
    assert fast[1][1] == fast[2][1] == {}
    # scans for tool results: the whole history on first sight, then only what is new
    n = len(msgs) + 1
    assert fast[0][2] == n and [s for _, _, s in slow] == [n, n, n, n + 8]
    assert fast[1][2] == fast[2][2] == 1 and fast[3][2] == 8 + 1


@pytest.mark.parametrize("budget", [200, 4500])
@pytest.mark.parametrize("name", ["chat", "anthropic"])
def test_compaction_kept_along_a_session_is_what_a_cold_request_gets(
        name: str, budget: int) -> None:
    """The compacted items and groups a session keeps from request to request (toolscan):
    when more of an item's or a group's results become eligible (keep_recent: the newest
    result stays whole until the next one comes, at 4,500 tokens; at 200 it cannot fit
    whole and is compacted at once), they are compacted anew; every request decides what
    the same request with nothing cached decides."""
    wire, to_body = WIRES[name]
    long = "row {k}: status ok, size 512, owner ops; " * 250  # bodies over 16 KiB: spliced
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "read both"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
            for k in (1, 2)]},
        {"role": "tool", "tool_call_id": "c1", "content": long.format(k=1)},
        {"role": "tool", "tool_call_id": "c2", "content": long.format(k=2)},
        {"role": "assistant", "content": "both read"}]
    for t in range(3, 8):
        msgs += [{"role": "user", "content": f"step {t}"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{t}", "type": "function",
                      "function": {"name": "read", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{t}", "content": long.format(k=t)},
                 {"role": "assistant", "content": f"done {t}"}]
    memory = {"enable_eviction": True,
              "budget": {"max_tokens": budget, "max_chars": None, "max_messages": None},
              "eviction": {"order": ["pinned", "recent_turns", "compact_tools", "length"],
                           "compact": {"min_chars": 50, "target_chars": 200, "max_line": 40,
                                       "keep_recent": 1}}}
    rules, tok, cache = make_rules(memory), Tokenizers(50_000), HistoryCache(1 << 24, 10)

    def seen(d: Decision) -> tuple[Any, ...]:
        assert d.conv is not None
        return (d.plan, d.forward, d.compacted, d.compact_tokens,
                [(g.chars, g.indices) for g in d.conv.groups])

    # a request each time the model is to answer: after a user message, after the results
    ends = [e for e in range(2, len(msgs) + 1) if msgs[e - 1]["role"] == "user"
            or (msgs[e - 1]["role"] == "tool" and (e == len(msgs) or msgs[e]["role"] != "tool"))]
    grew, before = False, {}
    for end in ends:
        raw = orjson.dumps(to_body(msgs[:end]))
        body, src = cache.loads(raw, wire, "t")  # as the server: the resent items are reused
        warm = decide(raw, body, rules, tok, wire, history=cache, key=("t", "s"), spliced=src)
        cache.remember(("t", "s"), raw, warm.payload, warm.messages, src, spans=True)
        cold = decide(raw, orjson.loads(raw), rules, Tokenizers(50_000), wire)
        assert seen(warm) == seen(cold)
        assert warm.conv is not None
        now = {}  # a group's first item -> the results compacted in it
        for g in warm.conv.groups:
            got = {(i, path) for i in g.indices for path, _ in warm.compacted.get(i, [])}
            if got:
                now[g.indices[0]] = got
        grew = grew or (src is not None  # the resent items the same objects as before
                        and any(k in now and was < now[k] for k, was in before.items()))
        before = now
    assert grew or budget < 1000  # a group (chat) or an item (anthropic) had more of its
    # results compacted


def test_a_history_that_fits_by_its_count_is_not_planned(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Shipped rules, eviction on: a body over the budget in bytes but not in tokens
    (what most requests of a session are until it outgrows the budget) is counted, not
    planned (no stage runs, no scan for tool results) while what is left to count is
    small; its plan is the one the stages come to (every message kept, as `fits`, its
    count the [mem] line's est_tokens); a cold one with much to count is planned."""
    calls, scanned = counting(monkeypatch, tuple(STAGES))
    tok = Tokenizers(50_000)

    def session(rules: Rules, histories: list[list[dict[str, Any]]]
                ) -> list[tuple[Any, list[str], int, int]]:
        cache, out = HistoryCache(1 << 26, 10), []
        for msgs in histories:
            body = orjson.dumps({"model": "gpt-4o-mini", "messages": [
                *msgs, {"role": "user", "content": "and now?"}]})
            calls.clear()
            scanned.clear()
            d = decide(body, orjson.loads(body), rules, tok, history=cache, key=("t", "s"))
            assert d.plan is not None and d.budget_tokens is not None
            assert len(body) > d.budget_tokens  # the bytes do not tell
            out.append((outcome(d), list(calls), sum(scanned), d.est_tokens()))
        return out

    # 9 messages (two tool results of ~3 KB) cold, then grown by a turn at a time: all
    # under the 6,000 tokens
    grown = [agent_history(n) for n in (9, 13, 17)]
    fast, slow = session(shipped(), grown), session(shipped("exactfit"), grown)
    assert [o for o, *_ in fast] == [o for o, *_ in slow]
    for (o, stages, scans, est), (_, slow_stages, _, _) in zip(fast, slow, strict=True):
        plan = o[1]
        assert not plan.dropped and set(plan.kept_by) == {"fits"}
        assert plan.kept_tokens == est <= 6000
        assert stages == [] and scans == 0
        assert slow_stages  # the long way: the stages keep it all
    # cold with more than EXACT_CHARS to count (prose: fewer tokens than characters / 4)
    # is planned, and all kept the same
    prose = "the quick brown fox jumps over the lazy dog. " * 400
    assert len(prose) > EXACT_CHARS
    (o, stages, _, est), = session(shipped(), [[{"role": "user", "content": prose},
                                                 {"role": "assistant", "content": "ok"}]])
    assert stages and not o[1].dropped and set(o[1].kept_by) == {"fits"}
    assert o[1].kept_tokens == est <= 6000


def test_counts_the_session_has_not_made_are_not_made_before_the_plan() -> None:
    """A body decided again (with store recall; or a concurrent request of the session)
    finds the session's counts of a cut history with gaps (the plan counted what it
    kept): they are left for after forwarding, as the first time, not counted first."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You help."}]
    for t in range(300):
        msgs += [{"role": "user", "content": f"question {t} " + "lorem ipsum dolor " * 40},
                 {"role": "assistant", "content": f"answer {t} " + "adipiscing elit " * 40}]
    body = orjson.dumps({"model": "gpt-4o-mini", "messages": [
        *msgs, {"role": "user", "content": "and now?"}]})
    cfg = yaml.safe_load((ROOT / "rules" / "gateway.yaml").read_text(encoding="utf-8"))
    cfg["memory"]["enable_eviction"] = True
    cfg["memory"]["eviction"]["low_water"] = 1.0
    rules = build_rules(cfg, base_dir=ROOT / "rules")
    cache, tok = HistoryCache(1 << 26, 10), Tokenizers(50_000)
    first = decide(body, orjson.loads(body), rules, tok, history=cache, key=("t", "s"))
    assert first.plan is not None and first.plan.dropped
    gaps = first._msg_tokens.count(-1) if first._msg_tokens is not None else 0
    assert gaps > 300  # the plan counted the newest turns only
    again = decide(body, orjson.loads(body), rules, tok, history=cache, key=("t", "s"),
                   recalled=["a record the store recalled"])
    assert again.view is not None and again.view.known == len(again.messages)
    assert again._msg_tokens is not None and again._msg_tokens.count(-1) >= gaps - 10
