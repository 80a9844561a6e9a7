"""The planner on literal histories and on the samples (golden kept/dropped lists)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config.rules import build_rules, load_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.errors import BadRequest, OverBudget
from gateway.measure.conversation import Unplannable
from gateway.measure.tokens import Tokenizers
from gateway.wire import openai_chat

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(10_000)


def rules(**memory: Any) -> Rules:
    base: dict[str, Any] = {"enable_eviction": True,
                            "budget": {"max_tokens": None, "max_chars": None,
                                       "max_messages": None, "max_turns": None},
                            "eviction": {"recall_share": 0.0}}  # the stages alone (test_fill)
    for k, v in memory.items():
        if isinstance(v, dict):
            base.setdefault(k, {}).update(v)
        else:
            base[k] = v
    return build_rules({"memory": base, "tokens": {"models_file": "rules/models.yaml"}},
                       base_dir=ROOT)


def plan_of(msgs: list[dict[str, Any]], r: Rules) -> Any:
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    return decide(raw, orjson.loads(raw), r, TOK).plan


def u(text: str, **kw: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **kw}


def a(text: str | None, **kw: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": text, **kw}


def call(*ids: str) -> dict[str, Any]:
    return a(None, tool_calls=[{"id": i, "type": "function",
                                "function": {"name": "f", "arguments": "{}"}} for i in ids])


def result(cid: str, text: str = "ok") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": text}


SYS = {"role": "system", "content": "sys"}


def test_max_turns_drops_whole_old_turns() -> None:
    """max_turns=2 keeps the last two turns whole and the system prompt."""
    msgs = [SYS, u("t1"), a("r1"), u("t2"), call("c1"), result("c1"), a("r2"), u("t3"), a("r3")]
    p = plan_of(msgs, rules(budget={"max_turns": 2}))
    assert p.kept == (0, 3, 4, 5, 6, 7, 8)
    assert p.dropped == ((1, "recent_turns"), (2, "recent_turns"))
    assert p.evict == "recent_turns"


def test_length_keeps_newest_turns_contiguously() -> None:
    """By characters: newest turns first, stop at the first that does not fit."""
    msgs = [SYS, u("a" * 50), a("b" * 50), u("c" * 10), a("d" * 200), u("e" * 10), a("f" * 10)]
    # system 3 + current 20 = 23; turn 2 costs 210 (does not fit 100); turn 1 is older
    p = plan_of(msgs, rules(budget={"max_chars": 150}))
    assert p.kept == (0, 5, 6)
    assert [s for _, s in p.dropped] == ["length"] * 4


def test_tool_call_and_results_are_one_unit_in_group_mode() -> None:
    """drop_unit group drops a big tool group inside an old turn but never splits it."""
    msgs = [SYS, u("q1"), call("c1", "c2"), result("c2", "x" * 500), result("c1", "y"),
            a("summary"), u("q2"), a("r2")]
    p = plan_of(msgs, rules(budget={"max_chars": 100}, eviction={"drop_unit": "group"}))
    assert p.kept == (0, 1, 5, 6, 7)
    assert dict(p.dropped) == {2: "length", 3: "length", 4: "length"}


def test_pinned_survives_and_brings_its_user_message() -> None:
    """A [PIN] assistant reply in an old turn is kept with the user message opening its turn."""
    msgs = [SYS, u("q1"), a("[PIN] the answer is 42"), u("q2" * 100), a("r2" * 100), u("q3")]
    p = plan_of(msgs, rules(budget={"max_chars": 80}))
    assert p.kept == (0, 1, 2, 5)
    assert p.pinned == 1
    assert dict(zip(p.kept, p.kept_by, strict=True)) == {
        0: "system", 1: "pinned", 2: "pinned", 5: "current"}


def test_metadata_pin_ttl_expires() -> None:
    """A pin with ttl=1 protects its message for one turn, then it is ordinary history."""
    pin = {"memgate": {"pin": True, "ttl": 1}}
    young = [u("q1", **pin), a("r1" * 50), u("q2")]
    old = [u("q1", **pin), a("r1" * 50), u("q2"), a("r2"), u("q3")]
    assert 0 in plan_of(young, rules(budget={"max_chars": 10})).kept
    assert 0 not in plan_of(old, rules(budget={"max_chars": 10})).kept


def test_score_pins_at_min_score_and_max_pinned_caps() -> None:
    """score >= min_score pins; max_pinned keeps the highest ranked, reports the overflow."""
    msgs = [u("a", memgate={"score": 0.9}), a("x" * 40), u("b", memgate={"score": 0.7}),
            a("y" * 40), u("c", memgate={"score": 0.69}), a("z" * 40), u("now")]
    p = plan_of(msgs, rules(budget={"max_chars": 10}, eviction={"max_pinned": 1}))
    assert p.kept == (0, 6)
    assert p.pinned_overflow == 1
    p2 = plan_of(msgs, rules(budget={"max_chars": 10}, eviction={"max_pinned": 5}))
    assert p2.kept == (0, 2, 6)


def test_order_puts_recent_turns_before_pins() -> None:
    """order [recent_turns, pinned, length]: the turn cap wins over an old pin."""
    msgs = [u("[PIN] keep me"), a("r"), u("q2"), a("r2"), u("q3")]
    p = plan_of(msgs, rules(budget={"max_turns": 2},
                            eviction={"order": ["recent_turns", "pinned", "length"]}))
    assert 0 not in p.kept
    p2 = plan_of(msgs, rules(budget={"max_turns": 2}))
    assert 0 in p2.kept


def test_the_budget_counts_the_history_on_top_of_the_floor() -> None:
    """A system prompt and a current turn far over the budget cut nothing: the budget
    counts what can be cut, and the floor comes on top (fixed_tokens says how much);
    the history over the budget is cut to it."""
    big_sys = {"role": "system", "content": "s" * 5000}
    p = plan_of([big_sys, u("old"), a("old"), u("x" * 500)], rules(budget={"max_chars": 100}))
    assert p.kept == (0, 1, 2, 3) and not p.over_budget and not p.dropped
    msgs = [big_sys, u("o" * 60), a("o" * 60), u("n" * 30), a("n" * 30), u("x" * 500)]
    p = plan_of(msgs, rules(budget={"max_chars": 100, "max_tokens": 10_000}))
    assert p.kept == (0, 3, 4, 5) and not p.over_budget
    assert p.fixed_chars == 5000 + 500 and p.kept_chars - p.fixed_chars <= 100
    assert p.fixed_tokens is not None and p.fixed_tokens > 5000 // 8


def test_over_budget_forwards_forced_part() -> None:
    """Pins beyond the history budget: forwarded as they are, flagged over_budget."""
    msgs = [SYS, u("[PIN] " + "p" * 300), a("ok"), u("old"), a("old"), u("x" * 500)]
    p = plan_of(msgs, rules(budget={"max_chars": 100}))
    assert p.kept == (0, 1, 5) and p.over_budget


def test_over_budget_reject_is_a_400() -> None:
    """on_over_budget: reject refuses with a clear error instead."""
    msgs = [SYS, u("[PIN] " + "p" * 300), a("ok"), u("x" * 500)]
    raw = orjson.dumps({"model": "gpt-4o-mini", "messages": msgs})
    r = rules(budget={"max_chars": 100}, eviction={"on_over_budget": "reject"})
    with pytest.raises(OverBudget, match="pinned messages"):
        decide(raw, orjson.loads(raw), r, TOK)


def test_auto_budget_uses_window_minus_output() -> None:
    """max_tokens auto = (context window - requested output) x safety ratio."""
    r = rules(budget={"max_tokens": "auto", "safety_ratio": 0.5})
    raw = orjson.dumps({"model": "gpt-4o", "max_tokens": 28000, "messages": [u("hi")]})
    d = decide(raw, orjson.loads(raw), r, TOK)
    assert d.budget_tokens == (128000 - 28000) // 2


def test_unpaired_and_bad_metadata() -> None:
    """An orphan tool result is unplannable; malformed metadata is a client error when
    eviction is on and markers.on_bad_metadata is reject."""
    with pytest.raises(Unplannable):
        openai_chat.parse([u("q"), result("nope")], "[PIN]", 0.7)
    raw = orjson.dumps({"messages": [u("q", memgate={"ttl": -1})]})
    with pytest.raises(BadRequest, match=r"messages\[0\]\.memgate\.ttl"):
        decide(raw, orjson.loads(raw), rules(markers={"on_bad_metadata": "reject"}), TOK)


def test_results_far_from_their_call_stay_together() -> None:
    """Results separated from their call by another message form one atomic span."""
    msgs = [u("q"), call("c1"), a("thinking"), result("c1"), u("now")]
    conv = openai_chat.parse(msgs, "[PIN]", 0.7)
    assert [g.indices for g in conv.groups] == [[0], [1, 2, 3], [4]]


def test_jq_character_definition() -> None:
    """hist_chars follows the seed's jq expression, null counting 0."""
    msgs = [u("héllo"), a(None), {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    conv = openai_chat.parse(msgs, "[PIN]", 0.7)
    assert conv.chars == [5, 0, len('[{"type":"text","text":"x"}]')]


# ------------------------------------------------------------------ golden (samples/)

# the caps these goldens were written for (the shipped ones hold more than the budget)
CAPS = {"max_chars": 24000, "max_messages": 60, "max_turns": 20}


def golden(name: str, low_water: float = 0.6) -> Any:
    r = load_rules(ROOT / "rules" / "gateway.yaml", {"MEMGATE_ENABLE_EVICTION": "1"})
    memory = replace(r.memory, eviction=replace(r.memory.eviction, low_water=low_water,
                                                recall_share=0.0),
                     budget=replace(r.memory.budget, **CAPS),
                     carry=replace(r.memory.carry, enabled=False))  # the planner alone
    raw = (ROOT / "samples" / f"{name}.json").read_bytes()
    return decide(raw, orjson.loads(raw), replace(r, memory=memory), TOK)


def test_golden_long_tools_sliding() -> None:
    """low_water 1.0: system, the [PIN] constraint, the pinned turn-12 finding, recent turns
    up to the 60-message budget."""
    d = golden("chat_long_tools", low_water=1.0)
    p = d.plan
    assert p.kept == (0, 1, 56, 62, *range(101, 154))
    assert d.messages[62]["content"].startswith("[PIN] Confirmed")
    assert p.pinned == 2 and not p.over_budget
    dropped = dict(p.dropped)
    assert all(dropped[i] == "recent_turns" for i in range(2, 56))
    assert all(dropped[i] == "length" for i in range(63, 101))


def replay_growing(name: str, low_water: float) -> tuple[list[int], int]:
    """Replay a sample turn by turn: kept sizes and how often the forwarded prefix changed."""
    r = load_rules(ROOT / "rules" / "gateway.yaml", {"MEMGATE_ENABLE_EVICTION": "1"})
    r = replace(r, memory=replace(r.memory, eviction=replace(r.memory.eviction,
                                                             low_water=low_water,
                                                             recall_share=0.0),
                                  budget=replace(r.memory.budget, **CAPS),
                                  carry=replace(r.memory.carry, enabled=False)))
    body = orjson.loads((ROOT / "samples" / f"{name}.json").read_bytes())
    sizes, changed, prev = [], 0, ()
    for end in [i for i, m in enumerate(body["messages"]) if m["role"] == "user"]:
        req = {**body, "messages": body["messages"][: end + 1]}
        kept = decide(orjson.dumps(req), req, r, TOK).plan.kept
        if kept[: len(prev)] != prev:
            changed += 1
        sizes.append(len(kept))
        prev = kept
    return sizes, changed


def test_golden_growing_session_low_water() -> None:
    """Turn by turn, low_water 0.6 cuts to ~60% of the 60-message budget and then keeps
    the cut for several requests (a sawtooth); the sliding window moves almost every time."""
    sizes, changed = replay_growing("chat_long_tools", 0.6)
    assert sizes == [2, 4, 8, 12, 19, 23, 27, 34, 38, 42, 49, 53, 57, 40, 44, 48, 55, 59,
                     37, 44, 48, 52, 59, 39, 43, 50, 54, 58, 46, 50, 54, 35]
    assert changed == 5
    sliding_sizes, sliding_changed = replay_growing("chat_long_tools", 1.0)
    assert max(sliding_sizes) <= 60 and sliding_changed > 3 * changed


def test_golden_zh_pinned() -> None:
    """The Chinese ops session: the metadata-pinned budget and the score-0.9 reply survive;
    the 20-turn cap moves in steps of 8 turns (turns 9..26 kept)."""
    d = golden("chat_zh_pinned")
    p = d.plan
    assert p.kept == (0, 1, 13, 14, *range(17, 52))
    assert p.pinned == 2
    assert d.messages[1]["content"].startswith("我们的预算是 10 万元")
    fwd = orjson.loads(d.forward)["messages"]
    assert all("memgate" not in m for m in fwd)


def test_golden_short_untouched() -> None:
    """A short chat is not even tokenized on the request path and forwards the same bytes."""
    d = golden("chat_short")
    assert d.plan.dropped == () and d.plan.kept_tokens is None
    assert d.forward is d.raw
