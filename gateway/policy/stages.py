"""The stages by name (`STAGES`) and their run: the stable part of a plan, the configured
stages over the history under the budget, once or, for a recall plan that drops, under
the stable part's share too (the planpass shortcut runs the budget-free stages once for
both), and memoized per history and floor (the plancache shortcut)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Container
from typing import Any

from gateway.measure.conversation import Conversation
from gateway.policy.length import fit_length_budget
from gateway.policy.pins import keep_by_score, keep_pinned
from gateway.policy.plan_rules import Limits, PlanRules
from gateway.policy.recent_turns import keep_recent_turns
from gateway.policy.state import DROP, MARKS, Cost, State, start_state

Stage = Callable[[State], None]  # decides some of the undecided groups of the state

# by the names PlanRules.order lists them in
STAGES: dict[str, Stage] = {
    "pinned": keep_pinned,
    "recent_turns": keep_recent_turns,
    "length": fit_length_budget,
    "score": keep_by_score,
}


def _run_stages(
    conv: Conversation, rules: PlanRules, lim: Limits, tokens_of: Callable[[int], int],
    overhead_tokens: int, tokens_key: Any, group_tokens: list[int] | None = None,
    cuttable: Container[int] = (),
) -> State:
    """The configured stages under `lim`; `group_tokens`: counts an earlier run made."""
    st = start_state(conv, rules, lim, tokens_of, overhead_tokens, tokens_key, group_tokens,
                     cuttable)
    for name in rules.order:
        STAGES[name](st)
    return st


def _drops(st: State) -> bool:
    """Did a stage drop anything? (a C-level search for each drop mark: every decision
    is one of the MARKS objects)"""
    k, kept = st.capped
    if st.dropped_prefix[0] or k > len(kept):
        return True
    decision = st.decision
    return any(m in decision for (kind, _), m in list(MARKS.items()) if kind == DROP)


# stages whose decisions read no budget: the same under any limits (pinned keeps up to
# max_pinned pins whatever they cost, recent_turns counts turns)
_BUDGET_FREE = frozenset({"pinned", "recent_turns"})


def _fork(st: State, lim: Limits, turn_costs: dict[int, Cost]) -> State:
    """A copy of st to run the remaining stages on under `lim` (the token counts and the
    turns' anchors, facts of the history, are shared)."""
    fork = State(
        conv=st.conv, rules=st.rules, tokens_of=st.tokens_of, count_tokens=st.count_tokens,
        decision=list(st.decision), tokens_used=st.tokens_used, chars_used=st.chars_used,
        messages_used=st.messages_used, anchors=st.anchors, group_tokens=st.group_tokens,
        pinned_overflow=st.pinned_overflow, fill_fallback=st.fill_fallback,
        max_turns=lim.max_turns, first_current=st.first_current,
        dropped_prefix=st.dropped_prefix, capped=st.capped, turn_costs=turn_costs,
        tokens_key=st.tokens_key, floor_tokens=st.floor_tokens, floor_chars=st.floor_chars,
    )
    fork.set_caps(lim)
    return fork


def _run_passes(base: State, lim: Limits, stable: Limits, recall: bool, overhead_tokens: int,
                cuttable: Container[int] = ()) -> tuple[State, bool]:
    """The stable part: (the state the stages left, whether the fill runs on it). With
    `recall`, the stages run under `lim` and, if that drops, again under `stable` (the
    fill then has the rest). `base` is start_state's state under `lim`."""
    conv, rules = base.conv, base.rules
    order = rules.order
    if "planpass" in rules.shortcuts_off:  # both passes from the start
        st = _run_stages(conv, rules, lim, base.tokens_of, overhead_tokens, base.tokens_key,
                         cuttable=cuttable)
        if not (recall and _drops(st)):
            return st, False
        return _run_stages(conv, rules, stable, base.tokens_of, overhead_tokens,
                           base.tokens_key, st.group_tokens, cuttable), True
    # recent_turns reads the turn cap, which the stable part has its share of
    free = _BUDGET_FREE if lim.max_turns == stable.max_turns else {"pinned"}
    k = 0
    while k < len(order) and order[k] in free:
        k += 1
    for name in order[:k]:  # once for both passes
        STAGES[name](base)
    rest = order[k:]
    if recall and _drops(base):  # the full-budget pass drops what these did: skipped
        base.set_caps(stable)
        base.max_turns = stable.max_turns
        st, fill = base, True
    elif not recall:
        st, fill = base, False
    else:
        full = _fork(base, lim, {})
        for name in rest:
            STAGES[name](full)
        if not _drops(full):
            return full, False
        # the length stage's turn costs are the same in both passes when it comes first
        # (the same groups are open there)
        st, fill = _fork(base, stable, full.turn_costs if rest[:1] == ("length",) else {}), True
    for name in rest:
        STAGES[name](st)
    return st, fill


_STABLE_KEY = "plan_stable"
_STABLE_ENTRIES = 4  # floors / rules remembered per history (a note's narrower budget...)


def stable_part(base: State, lim: Limits, stable: Limits, recall: bool, overhead_tokens: int,
                cuttable: Container[int] = ()) -> tuple[State, bool]:
    """_run_passes, or what it gave for the same history (the same group objects: a session's
    unchanged history, history.join), the same floor and rules, from the conversation's
    memo: the stable part is a function of those alone (the fill, which reads the
    current request's words, is not memoized)."""
    rules, conv, fc = base.rules, base.conv, base.first_current
    if "plancache" in rules.shortcuts_off or base.tokens_key is None or not fc:
        return _run_passes(base, lim, stable, recall, overhead_tokens, cuttable)
    groups = conv.groups
    key = (rules, base.tokens_key, conv.n_turns, recall, base.tokens_used, base.chars_used,
           base.messages_used, base.floor_tokens, base.floor_chars)
    memo = conv.memo.get(_STABLE_KEY)
    if (memo is None or len(memo[0]) != fc
            or not all(map(operator.is_, memo[0], groups[:fc]))):
        memo = conv.memo[_STABLE_KEY] = (groups[:fc], {})
    entries: dict[Any, Any] = memo[1]
    hit = entries.get(key)
    if hit is not None:
        (decision, counts, base.tokens_used, base.chars_used, base.messages_used,
         base.pinned_overflow, base.fill_fallback, base.dropped_prefix, base.capped,
         fill) = hit
        base.decision[:fc] = decision
        base.group_tokens[:fc] = counts
        if fill:
            base.set_caps(stable)
            base.max_turns = stable.max_turns
        return base, fill
    st, fill = _run_passes(base, lim, stable, recall, overhead_tokens, cuttable)
    if len(entries) >= _STABLE_ENTRIES:
        entries.clear()
    entries[key] = (st.decision[:fc], st.group_tokens[:fc], st.tokens_used, st.chars_used,
                    st.messages_used, st.pinned_overflow, st.fill_fallback, st.dropped_prefix,
                    st.capped, fill)
    return st, fill
