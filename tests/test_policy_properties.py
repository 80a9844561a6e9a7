"""Every invariant of ARCHITECTURE.md, as properties over generated histories."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.chat import Decision, decide
from gateway.conversation import is_active
from gateway.policy import Plan
from gateway.rules import Rules, build_rules
from gateway.tokens import Tokenizers
from gateway.wire import openai_chat

from .strategies import conversation, memory_rules

ROOT = Path(__file__).resolve().parent.parent
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
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    return users[-1]


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


@given(msgs=conversation(), memory=memory_rules())
@SETTINGS
def test_budget_respected_unless_over_budget(
    msgs: list[dict[str, Any]], memory: dict[str, Any]
) -> None:
    """Kept history fits every limit, or over_budget is set and only forced parts were kept."""
    rules = make_rules(memory)
    d = run(msgs, rules)
    p = d.plan
    assert p is not None
    b = rules.memory.budget
    tokens = d.overhead_tokens() + sum(d.message_tokens(i) for i in p.kept)
    chars = sum(d.conv.text_chars[i] for i in p.kept) if d.conv else 0
    fits = (
        (b.max_tokens is None or tokens <= b.max_tokens)
        and (b.max_chars is None or chars <= b.max_chars)
        and (b.max_messages is None or len(p.kept) <= b.max_messages)
    )
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
    previous forwarded messages plus the new ones still fit the budget (unless the previous
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
        assert p is not None
        if not p.over_budget:
            assert p.kept_chars <= max_chars
        if prev is not None:
            grown = (*prev, *range(prev_n, len(history)))
            chars = sum(d.conv.text_chars[i] for i in grown) if d.conv else 0
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
