"""Every invariant of ARCHITECTURE.md, as properties over generated histories."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.config.schema import CONTEXT_PREFIXES, Rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.measure.conversation import is_active
from gateway.measure.tokens import Tokenizers
from gateway.policy import Limits, Plan, PlanRules
from gateway.policy.compact import compact_text
from gateway.policy.length import checkpoint_turns
from gateway.policy.state import State, caps
from gateway.wire import openai_chat
from tests.strategies import conversation, memory_rules

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKENIZERS = Tokenizers(50_000)
SETTINGS = settings()  # the profile chosen in conftest.py


def make_rules(memory: dict[str, Any]) -> Rules:
    return build_rules({"memory": memory, "tokens": {"models_file": "rules/models.yaml"}},
                       base_dir=ROOT)


def run(msgs: list[dict[str, Any]], rules: Rules) -> Decision:
    body = {"model": "gpt-4o-mini", "messages": msgs}
    raw = orjson.dumps(body)
    return decide(raw, orjson.loads(raw), rules, TOKENIZERS)


def assert_dropped_listing(p: Plan) -> None:
    """The dropped messages as listed and as counted (from runs of groups) agree; the
    listing is ascending, without repeats, and the `evict` stage dropped the most."""
    listed = list(p.dropped)
    assert len(p.dropped) == len(listed) and bool(p.dropped) == bool(listed)
    assert [i for i, _ in listed] == sorted({i for i, _ in listed})
    stages = Counter(s for _, s in listed)
    assert p.evict == (max(sorted(stages), key=lambda s: stages[s]) if stages else "none")


def current_turn_start(msgs: list[dict[str, Any]]) -> int:
    """Where the caller's input since the model's last reply begins: the run of user
    messages that ends the list (a document, then the question), else the last one."""
    k = len(msgs)
    while k and msgs[k - 1]["role"] == "user":
        k -= 1
    return k if k < len(msgs) else [i for i, m in enumerate(msgs) if m["role"] == "user"][-1]


@given(msgs=conversation(), memory=memory_rules())
@SETTINGS
def test_structure_invariants(msgs: list[dict[str, Any]], memory: dict[str, Any]) -> None:
    """Ordered subsequence (recalled history moved before the current turn); system and
    current turn kept; tool pairs whole; starts with user."""
    rules = make_rules(memory)
    d = run(msgs, rules)
    assert d.plan is not None
    p = d.plan
    kept = list(p.kept)
    assert kept == sorted(set(kept))
    assert set(kept).isdisjoint(i for i, _ in p.dropped)
    assert set(kept) | {i for i, _ in p.dropped} == set(range(len(msgs)))
    assert_dropped_listing(p)
    for i, m in enumerate(msgs):
        if m["role"] in ("system", "developer"):
            assert i in kept
    assert set(range(current_turn_start(msgs), len(msgs))) <= set(kept)

    # recalled history: kept, forwarded after the stable part and before the current turn
    cur = current_turn_start(msgs)
    recalled = list(p.recalled)
    assert recalled == sorted(set(recalled)) and set(recalled) <= set(kept)
    assert all(i < cur and msgs[i]["role"] not in ("system", "developer") for i in recalled)
    order = d.forwarded()
    assert order == ([i for i in kept if i < cur and i not in recalled] + recalled
                     + [i for i in kept if i >= cur])
    out = orjson.loads(d.forward)["messages"]
    # kept messages are unchanged except for the stripped gateway metadata
    assert out == [{k: v for k, v in msgs[i].items() if k != "memgate"} for i in order]
    calls: dict[str, int] = {}
    for j, m in enumerate(out):
        for c in m.get("tool_calls") or []:
            calls[c["id"]] = j
    results = {m["tool_call_id"]: j for j, m in enumerate(out) if m["role"] == "tool"}
    assert set(calls) == set(results), "a tool call without its result or an orphan result"
    for cid, j in results.items():
        assert calls[cid] < j
    first = next(m for m in out if m["role"] not in ("system", "developer"))
    assert first["role"] == "user"


def floor_of(msgs: list[dict[str, Any]]) -> set[int]:
    """What the budget never counts, found from the chat history alone: system and
    developer messages, the user messages of the opening context (before the first other
    message, opening with a context prefix), and the current turn (from the last user
    message, or from the first of the user messages the history ends with)."""
    fixed: set[int] = set()
    opening = True
    for i, m in enumerate(msgs):
        if m["role"] in ("system", "developer"):
            fixed.add(i)
        elif opening and m["role"] == "user" and str(m["content"]).lstrip().startswith(
                CONTEXT_PREFIXES):
            fixed.add(i)
        else:
            opening = False
    users = [i for i, m in enumerate(msgs) if m["role"] == "user" and i not in fixed]
    start = users[-1] if users else len(msgs)
    k = len(msgs)
    while k and msgs[k - 1]["role"] == "user" and k - 1 not in fixed:
        k -= 1
    return fixed | set(range(min(start, k), len(msgs)))


@given(msgs=conversation(), memory=memory_rules())
@SETTINGS
def test_budget_respected_unless_over_budget(
    msgs: list[dict[str, Any]], memory: dict[str, Any]
) -> None:
    """The kept history fits every limit on top of the floor (what is never cut: system,
    the opening context, the current turn), or over_budget is set and only forced parts
    were kept; a history that fits on top of the floor is kept whole (without compaction,
    which counts old results of the current turn as history)."""
    rules = make_rules(memory)
    d = run(msgs, rules)
    p = d.plan
    assert p is not None and d.conv is not None
    b = rules.memory.budget
    floor = floor_of(msgs)
    floor_tokens = d.overhead_tokens() + sum(d.planned_tokens(i) for i in floor)
    floor_chars = sum(d.conv.text_chars[i] for i in floor)
    tokens = d.overhead_tokens() + sum(d.planned_tokens(i) for i in p.kept) - floor_tokens
    chars = sum(d.conv.text_chars[i] for i in p.kept) - floor_chars
    fits = (
        (b.max_tokens is None or tokens <= b.max_tokens)
        and (b.max_chars is None or chars <= b.max_chars)
        and (b.max_messages is None or len(p.kept) <= b.max_messages)
    )
    order = rules.memory.eviction.order
    everything = (
        (b.max_tokens is None or d.overhead_tokens() + sum(
            d.planned_tokens(i) for i in range(len(msgs))) - floor_tokens <= b.max_tokens)
        and (b.max_chars is None or sum(d.conv.text_chars) - floor_chars <= b.max_chars)
        and (b.max_messages is None or len(msgs) <= b.max_messages)
        and (b.max_turns is None or d.conv.n_turns <= b.max_turns))
    if everything and "compact_tools" not in order and not p.over_budget:
        assert not p.dropped, (p.dropped, floor)
    order = rules.memory.eviction.order
    if "length" in order:
        assert fits or p.over_budget
    if p.over_budget:
        assert not fits
        if "length" in order and order.index("length") == len(order) - 1:
            assert set(p.kept_by) <= {"system", "current", "pinned", "score"}
    if b.max_turns is not None and "recent_turns" in order:
        later = set(order[order.index("recent_turns") + 1 :]) | {"current", "fits"}
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        oldest_allowed = users[max(0, len(users) - b.max_turns)]
        for i, why in zip(p.kept, p.kept_by, strict=True):
            if why in later and msgs[i]["role"] != "system":
                assert i >= oldest_allowed or why == "fits"


@given(msgs=conversation(), memory=memory_rules())
@SETTINGS
def test_pinned_kept_up_to_max_pinned(msgs: list[dict[str, Any]], memory: dict[str, Any]) -> None:
    """With pinned first in the order, every active pin is kept or counted as overflow."""
    memory["eviction"]["order"] = ["pinned", "recent_turns", "length"]
    memory["eviction"]["keep_pinned"] = True
    rules = make_rules(memory)
    d = run(msgs, rules)
    assert d.plan is not None and d.conv is not None
    conv = d.conv
    active = [
        i for g in conv.groups for i, pin in g.pins
        if g.turn < conv.n_turns and is_active(pin, g.turn, conv.n_turns, 0.7)
    ]
    lost = [i for i in active if i not in d.plan.kept]
    assert len(lost) <= d.plan.pinned_overflow
    # `pinned` counts the active pins the forwarded history holds (the current turn too)
    held = [i for g in conv.groups for i, pin in g.pins
            if is_active(pin, g.turn, conv.n_turns, 0.7) and i in d.plan.kept]
    assert d.plan.pinned == len(held)
    if len(active) <= rules.memory.eviction.max_pinned:
        assert lost == []


def as_held(msgs: list[dict[str, Any]], d: Decision) -> list[dict[str, Any]]:
    """The kept messages with each pin as it held for this request.

    A ttl counts turns back from the current one; once turns between a pin and
    the current turn are dropped, the same ttl would count fewer turns. The
    output's pins are therefore pinned (held) or expired (ttl 0), as decided.
    """
    assert d.plan is not None and d.conv is not None
    held: dict[int, bool] = {}
    for g in d.conv.groups:
        for i, pin in g.pins:
            held[i] = is_active(pin, g.turn, d.conv.n_turns, 0.7)
    out = []
    for i in d.forwarded():
        m = dict(msgs[i])
        if i in held:
            score = m.get("memgate", {}).get("score")
            meta: dict[str, Any] = {"pin": True} if held[i] else {"ttl": 0}
            if score is not None:
                meta["score"] = score
            m["memgate"] = meta
        out.append(m)
    return out


@given(msgs=conversation(), memory=memory_rules())
@SETTINGS
def test_deterministic_and_idempotent(msgs: list[dict[str, Any]], memory: dict[str, Any]) -> None:
    """The same input plans the same; planning the kept history again drops nothing."""
    rules = make_rules(memory)
    d1 = run(msgs, rules)
    d2 = run(msgs, rules)
    assert d1.plan == d2.plan and d1.forward == d2.forward
    assert d1.plan is not None
    again = run(as_held(msgs, d1), rules)
    assert again.plan is not None
    assert again.plan.dropped == ()


@given(msgs=conversation(), memory=memory_rules(), shadow=st.booleans())
@SETTINGS
def test_eviction_off_forwards_identical_bytes(
    msgs: list[dict[str, Any]], memory: dict[str, Any], shadow: bool
) -> None:
    """enable_eviction false: the client's bytes go upstream unchanged (no gateway metadata)."""
    for m in msgs:
        m.pop("memgate", None)
    memory.update(enable_eviction=False, shadow=shadow)
    rules = make_rules(memory)
    body = {"model": "gpt-4o-mini", "messages": msgs, "temperature": 0.2}
    raw = orjson.dumps(body, option=orjson.OPT_INDENT_2)
    d = decide(raw, orjson.loads(raw), rules, TOKENIZERS)
    assert d.forward is raw


@given(msgs=conversation(max_turns=6))
@SETTINGS
def test_cheap_bound_never_changes_the_decision(msgs: list[dict[str, Any]]) -> None:
    """Skipping tokenization when bytes bound the tokens gives the plan exact counts give."""
    rules = make_rules({"enable_eviction": True,
                        "budget": {"max_tokens": 400, "max_chars": None, "max_messages": None,
                                   "max_turns": None}})
    d = run(msgs, rules)
    assert d.plan is not None
    exact = d.est_tokens()
    assert exact <= len(d.raw)
    if d.plan.kept_tokens is None:  # decided without counting
        assert exact <= 400 and d.plan.dropped == ()
    for i in range(len(msgs)):
        assert d.message_tokens(i) == openai_chat.message_tokens(msgs[i], d.counter)


@st.composite
def growing_session(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A session without pins and with a stable fixed part: every request is the previous
    history plus one turn. (System notes added mid-conversation make the always-kept part
    grow from request to request; when that leaves no checkpoint's tail room, the cut falls
    back to a plain newest-first fill, and the next checkpoint cut may move it once.)"""
    msgs = draw(conversation(max_turns=25))
    msgs = [m for i, m in enumerate(msgs) if m["role"] not in ("system", "developer")
            or all(x["role"] in ("system", "developer") for x in msgs[:i])]
    for m in msgs:
        m.pop("memgate", None)
        if isinstance(m.get("content"), str):
            m["content"] = m["content"].replace("[PIN]", "[pin]")
    return msgs


@given(msgs=growing_session(), max_chars=st.integers(200, 3000),
       max_messages=st.one_of(st.none(), st.integers(8, 40)),
       low_water=st.sampled_from([0.5, 0.6, 0.8, 1.0]))
@SETTINGS
def test_cut_stays_while_it_fits(
    msgs: list[dict[str, Any]], max_chars: int, max_messages: int | None, low_water: float
) -> None:
    """Along a growing session, the forwarded prefix stays byte-identical whenever the
    previous forwarded messages plus the new ones still fit the budget on top of the floor
    (system, opening context, the current turn) (unless the previous
    cut was the plain-fill fallback, taken when system + current turn exceed the low-water
    share); every request respects the budget; a lost state (restart) recomputes the very
    same cut. (The fill is off here: with it on, the stable part is this same cut under the
    budget's stable share, test_fill_leaves_the_stable_part_to_eviction.)"""
    rules = make_rules({"enable_eviction": True,
                        "budget": {"max_tokens": None, "max_chars": max_chars,
                                   "max_messages": max_messages, "max_turns": None},
                        "eviction": {"low_water": low_water, "recall_share": 0.0}})
    ends = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    prev: tuple[int, ...] | None = None
    prev_n = 0
    prev_fallback = False
    for end in ends:
        history = msgs[: end + 1]
        d = run(history, rules)
        p = d.plan
        assert p is not None and d.conv is not None
        floor_chars = sum(d.conv.text_chars[i] for i in floor_of(history))
        if not p.over_budget:
            assert p.kept_chars - floor_chars <= max_chars
        if prev is not None:
            grown = (*prev, *range(prev_n, len(history)))
            chars = sum(d.conv.text_chars[i] for i in grown) - floor_chars
            fits = chars <= max_chars and (max_messages is None or len(grown) <= max_messages)
            if fits and not prev_fallback:
                assert p.kept == grown, "the cut moved although the grown history fits"
        assert run(history, rules).plan == p  # stateless: a restart plans the same
        prev, prev_n, prev_fallback = p.kept, len(history), p.fill_fallback


@given(msgs=conversation(), memory=memory_rules())
@SETTINGS
def test_fill_leaves_the_stable_part_to_eviction(
    msgs: list[dict[str, Any]], memory: dict[str, Any]
) -> None:
    """With the fill on, what is kept besides the recalled history is exactly what eviction
    alone keeps under the stable share of the budget (or, when nothing has to go, under
    the whole budget): the fill never moves the cut, so the cached prefix stays."""
    memory["eviction"]["recall_share"] = 0.5
    d = run(msgs, make_rules(memory))
    assert d.plan is not None
    memory["eviction"]["recall_share"] = 0.0
    alone = run(msgs, make_rules(memory)).plan
    assert alone is not None
    if alone.dropped:
        memory["budget"] = {k: (v if v is None else max(1, int(v * 0.5)))
                            for k, v in memory["budget"].items()}
        alone = run(msgs, make_rules(memory)).plan
        assert alone is not None
    recalled = set(d.plan.recalled)
    assert tuple(i for i in d.plan.kept if i not in recalled) == alone.kept
    assert all(d.plan.kept_by[k] == "recalled" for k, i in enumerate(d.plan.kept)
               if i in recalled)


# --------------------------------------------------- with compact_tools in the order

@st.composite
def bulky_conversation(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A conversation some of whose tool results (pinned ones too) are long enough to be
    compacted: JSON rows, log lines with errors, one long string."""
    msgs = draw(conversation(max_turns=8))
    for m in msgs:
        if m["role"] == "tool" and draw(st.integers(0, 2)):
            n = draw(st.integers(5, 60))
            kind = draw(st.sampled_from(["rows", "log", "blob"]))
            if kind == "rows":
                m["content"] = orjson.dumps([{"id": k, "state": "ok" if k % 9 else "failed",
                                              "path": f"/data/orders/{k}.csv"}
                                             for k in range(n)]).decode()
            elif kind == "log":
                m["content"] = "\n".join(f"line {k} {'ERROR disk' if k % 13 == 4 else 'ok'} 订单"
                                         for k in range(n * 4))
            else:
                m["content"] = "[PIN] " * (n % 7 == 0) + "wörd " * (n * 30)
    return msgs


@st.composite
def compacting_rules(draw: st.DrawFn) -> dict[str, Any]:
    """memory_rules() with compact_tools before length and a small min_chars."""
    memory = draw(memory_rules())
    order = [s for s in memory["eviction"]["order"] if s != "length"]
    at = draw(st.integers(0, len(order)))
    memory["eviction"]["order"] = [*order[:at], "compact_tools", *order[at:], "length"]
    memory["eviction"]["compact"] = {"min_chars": draw(st.sampled_from([300, 800])),
                                     "keep_recent": draw(st.integers(0, 2))}
    return memory


@given(msgs=bulky_conversation(), memory=compacting_rules())
@SETTINGS
def test_invariants_hold_with_compaction(msgs: list[dict[str, Any]],
                                         memory: dict[str, Any]) -> None:
    """With compact_tools on: the order, system and current turn kept, pairs whole, the
    first message a user's, every forwarded message the client's but for a compacted tool
    result (never a pin, a system message, one of the newest keep_recent results of the
    current turn or one the model has not read; the rest of its message unchanged;
    compacting it again
    changes nothing), active pins kept up to max_pinned, the same bytes on every request,
    and planning the forwarded history again drops nothing."""
    rules = make_rules(memory)
    d = run(msgs, rules)
    p = d.plan
    assert p is not None and d.conv is not None
    kept = list(p.kept)
    assert kept == sorted(set(kept))
    cur = current_turn_start(msgs)
    assert all(i in kept for i, m in enumerate(msgs) if m["role"] in ("system", "developer"))
    assert set(range(cur, len(msgs))) <= set(kept)
    order = d.forwarded()
    recalled = list(p.recalled)
    assert order == ([i for i in kept if i < cur and i not in recalled] + recalled
                     + [i for i in kept if i >= cur])
    out = orjson.loads(d.forward)["messages"]
    assert len(out) == len(order)
    pinned = {i for g in d.conv.groups for i, _ in g.pins}
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    keep_recent = rules.memory.eviction.compact.keep_recent
    newest = set(tools[len(tools) - keep_recent:]) if keep_recent else set()
    last_assistant = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"),
                         default=-1)
    for i, m in zip(order, out, strict=True):
        client = {k: v for k, v in msgs[i].items() if k != "memgate"}
        if i in d.compacted:
            # one of the newest keep_recent is compacted only if whole it would cost its
            # turn: never in the current turn; and never one the model has not read (after
            # its last reply in the current turn; one a later user message follows is read)
            assert msgs[i]["role"] == "tool" and i not in pinned
            assert i not in newest or i < cur
            assert i < last_assistant or i < cur
            assert m["content"] != client["content"] and "[memgate: " in m["content"]
            assert compact_text(m["content"], rules.memory.eviction.compact) is None
            m = {**m, "content": client["content"]}
        assert m == client
    calls = {c["id"]: j for j, m in enumerate(out) for c in m.get("tool_calls") or []}
    results = {m["tool_call_id"]: j for j, m in enumerate(out) if m["role"] == "tool"}
    assert set(calls) == set(results)
    assert all(calls[c] < j for c, j in results.items())
    assert next(m for m in out if m["role"] not in ("system", "developer"))["role"] == "user"
    if rules.memory.eviction.order[0] == "pinned" and rules.memory.eviction.keep_pinned:
        active = [i for g in d.conv.groups for i, pin in g.pins
                  if g.turn < d.conv.n_turns and is_active(pin, g.turn, d.conv.n_turns, 0.7)]
        assert len([i for i in active if i not in kept]) <= p.pinned_overflow
    assert run(msgs, rules).forward == d.forward
    if not p.over_budget:
        held = as_held(msgs, d)
        for k, i in enumerate(order):
            if i in d.compacted:
                held[k] = {**held[k], "content": out[k]["content"]}
        again = run(held, rules)
        assert again.plan is not None and again.plan.dropped == ()


# ------------------------------------------------------------------ the checkpoints

_COUNTER: list[Any] = []


def counter() -> Any:
    """The counter the gateway uses for gpt-4o-mini (made once)."""
    if not _COUNTER:
        _COUNTER.append(TOKENIZERS.get(make_rules({}).model_info("gpt-4o-mini").encoding))
    return _COUNTER[0]


def checkpoints_of(history: list[dict[str, Any]], limits: Limits, low_water: float,
                   memo: dict[Any, Any] | None = None) -> tuple[list[int] | None, Any]:
    """The stepped cut's checkpoints of a history (before its current turn), counted as the
    gateway counts, resumed from `memo` when given; (checkpoints, the memo after)."""
    conv = openai_chat.parse(history, "[PIN]", 0.7)
    if memo is not None:
        conv.memo = memo
    n = len(conv.groups)
    max_tokens, max_chars, max_messages = caps(limits)
    st_ = State(
        conv=conv, rules=PlanRules(limits=limits, low_water=low_water),
        tokens_of=lambda i: openai_chat.message_tokens(history[i], counter()),
        count_tokens=limits.max_tokens is not None, decision=[None] * n,
        group_tokens=[-1] * n, max_tokens=max_tokens, max_chars=max_chars,
        max_messages=max_messages, tokens_key=(counter(), 1.0))
    end = n
    while end and conv.groups[end - 1].turn == conv.n_turns:
        end -= 1
    return checkpoint_turns(st_, end, 1.0 - low_water), conv


def turn_sizes(conv: Any, history: list[dict[str, Any]]) -> dict[int, tuple[int, int, int]]:
    sizes: dict[int, tuple[int, int, int]] = {}
    for g in conv.groups:
        if g.turn == conv.n_turns:
            continue
        t, c, m = sizes.get(g.turn, (0, 0, 0))
        sizes[g.turn] = (t + sum(openai_chat.message_tokens(history[i], counter())
                                 for i in g.indices), c + g.chars, m + len(g.indices))
    return sizes


@given(msgs=growing_session(),
       max_tokens=st.one_of(st.none(), st.integers(30, 600)),
       max_chars=st.one_of(st.none(), st.integers(100, 3000)),
       max_messages=st.one_of(st.none(), st.integers(4, 30)),
       low_water=st.sampled_from([0.3, 0.6, 0.8]))
@SETTINGS
def test_checkpoints_are_deterministic_and_prefix_stable(
    msgs: list[dict[str, Any]], max_tokens: int | None, max_chars: int | None,
    max_messages: int | None, low_water: float
) -> None:
    """Along a growing session the checkpoints are a function of the history (resumed from
    the previous request's memo or computed from the start, the same), each request's are
    a prefix of the next one's, and between two checkpoints no limited measure grows by a
    step ((1 - low_water) of its limit) before the turn that opens the next one."""
    limits = Limits(max_tokens=max_tokens, max_chars=max_chars, max_messages=max_messages)
    memo: dict[Any, Any] | None = None
    prev: list[int] | None = None
    for end in [i for i, m in enumerate(msgs) if m["role"] == "user"]:
        history = msgs[: end + 1]
        fresh, conv = checkpoints_of(history, limits, low_water)
        resumed, grown = checkpoints_of(history, limits, low_water, memo)
        assert resumed == fresh
        memo = grown.memo
        if prev is not None and fresh is not None:
            assert fresh[: len(prev)] == prev
        prev = fresh
    if prev is None:
        return
    sizes = turn_sizes(conv, history)
    caps = (max_tokens, max_chars, max_messages)
    turns = sorted(sizes)
    for a, b in zip(prev, prev[1:]):
        inside = [t for t in turns if a <= t < b][:-1]  # the turn before b may cross
        for k, cap in enumerate(caps):
            if cap is not None:
                assert sum(sizes[t][k] for t in inside) < (1.0 - low_water) * cap


@given(msgs=growing_session(), max_tokens=st.integers(30, 600),
       low_water=st.sampled_from([0.3, 0.6, 0.8]))
@SETTINGS
def test_token_checkpoints_sit_on_the_step_grid(
    msgs: list[dict[str, Any]], max_tokens: int, low_water: float
) -> None:
    """With a token budget alone, the checkpoints are the first turn and, for each multiple
    of the step ((1 - low_water) x max_tokens tokens, as counted), the first turn that
    starts at or past it: turn boundaries do not add up, so a cut that moves one checkpoint
    frees a step on average."""
    cps, conv = checkpoints_of(msgs, Limits(max_tokens=max_tokens), low_water)
    if cps is None:
        return
    sizes = turn_sizes(conv, msgs)
    step = (1.0 - low_water) * max_tokens
    want, offset, mark = [min(sizes)], 0, 0
    for t in sorted(sizes):
        if math.floor(offset / step) > mark:
            mark = math.floor(offset / step)
            want.append(t)
        offset += sizes[t][0]
    assert cps == want
