"""What the stages work on: one `State` per plan (the decision per group, the budget used
and left, the token counts made so far), made by `start_state` with the floor (system
part and current turn) kept, and the decision marks (one object per kind and stage, so
drops are found by identity). Pure: token counts come from the caller's callable, asked
only for what a decision needs."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.measure.conversation import Conversation
from gateway.policy.plan_rules import Limits, PlanRules

KEEP = "keep"
DROP = "drop"

_NO_LIMIT = 1 << 62
MARKS: dict[tuple[str, str], tuple[str, str]] = {}  # (KEEP|DROP, stage) -> its mark


def mark_of(kind: str, stage: str) -> tuple[str, str]:
    """One decision mark object per kind and stage: the plan finds runs of drops by
    identity (and no mark is allocated per decision)."""
    mark = MARKS.get((kind, stage))
    if mark is None:
        mark = MARKS[kind, stage] = (kind, stage)
    return mark


Cost = tuple[int, int, int]  # tokens, chars, messages


@dataclass(slots=True)
class State:
    """One plan's work in progress: a decision per group, what is kept so far against
    the caps, and facts of the history the stages share (token counts, turn anchors)."""

    conv: Conversation
    rules: PlanRules
    tokens_of: Callable[[int], int]
    count_tokens: bool
    decision: list[tuple[str, str] | None]  # per group: (KEEP|DROP, stage)
    tokens_used: int = 0
    chars_used: int = 0
    messages_used: int = 0
    anchors: dict[int, int | None] = field(default_factory=dict)  # turn -> its user group
    group_tokens: list[int] = field(default_factory=list)  # -1 = not counted yet
    pinned_overflow: int = 0
    fill_fallback: bool = False
    max_tokens: int = _NO_LIMIT
    max_chars: int = _NO_LIMIT
    max_messages: int = _NO_LIMIT
    max_turns: int | None = None  # the recent-turns cap of this run (the stable part's share)
    first_current: int = 0  # the first group of the current turn
    # (k, stage): groups[:k] all dropped by `stage` in one stroke (the recent-turns cap)
    dropped_prefix: tuple[int, str] = (0, "")
    # (k, kept): groups[:k] all dropped by the recent-turns cap but `kept`, which an
    # earlier stage kept (pins; recallscan)
    capped: tuple[int, tuple[int, ...]] = (0, ())
    turn_costs: dict[int, Cost] = field(default_factory=dict)  # cost of a turn's open groups
    tokens_key: Any = None  # see plan()
    # what the floor (system part, overhead, the current turn) takes: the token and
    # character limits count the history on top of it (Limits)
    floor_tokens: int = 0
    floor_chars: int = 0

    def set_caps(self, lim: Limits) -> None:
        """The caps under `lim`: its token and character limits on top of the floor."""
        max_tokens, max_chars, self.max_messages = caps(lim)
        self.max_tokens = max_tokens if lim.tokens_whole else max_tokens + self.floor_tokens
        self.max_chars = max_chars + self.floor_chars

    def tokens(self, g: int) -> int:
        n = self.group_tokens[g]
        if n < 0:
            if not self.count_tokens:
                n = 0
            else:
                grp, key = self.conv.groups[g], self.tokens_key
                if key is not None and grp.tokens_key == key:
                    n = grp.tokens
                else:
                    n = sum(map(self.tokens_of, grp.indices))
                    if key is not None:
                        grp.tokens, grp.tokens_key = n, key
            self.group_tokens[g] = n
        return n

    def turn_cost(self, turn: int, gs: Sequence[int]) -> Cost:
        """cost(gs) for a turn's undecided groups, computed once per plan."""
        c = self.turn_costs.get(turn)
        if c is None:
            c = self.turn_costs[turn] = self.cost(gs)
        return c

    def cost(self, gs: Sequence[int]) -> Cost:
        groups, known = self.conv.groups, self.group_tokens
        t = c = m = 0
        for g in gs:
            grp = groups[g]
            n = known[g]
            t += n if n >= 0 else self.tokens(g)
            c += grp.chars
            m += len(grp.indices)
        return t, c, m

    def fits(self, extra: Cost) -> bool:
        return (
            self.tokens_used + extra[0] <= self.max_tokens
            and self.chars_used + extra[1] <= self.max_chars
            and self.messages_used + extra[2] <= self.max_messages
        )

    def keep(self, gs: Sequence[int], stage: str, cost: Cost | None = None) -> None:
        """Keep the undecided groups of gs; `cost` is theirs when the caller has it."""
        decision = self.decision
        self.keep_open([g for g in gs if decision[g] is None], stage, cost)

    def keep_open(self, gs: Sequence[int], stage: str, cost: Cost | None = None) -> None:
        """keep() for groups the caller knows are all undecided."""
        decision = self.decision
        t, c, m = self.cost(gs) if cost is None else cost
        mark = mark_of(KEEP, stage)
        for g in gs:
            decision[g] = mark
        self.tokens_used += t
        self.chars_used += c
        self.messages_used += m

    def drop(self, g: int, stage: str) -> None:
        if self.decision[g] is None:
            self.decision[g] = mark_of(DROP, stage)

    def anchor(self, g: int) -> int | None:
        """The first user group of g's turn (None: the turn has none), found in the
        turn's own groups (they are contiguous) when first asked for."""
        groups = self.conv.groups
        turn = groups[g].turn
        if turn in self.anchors:
            return self.anchors[turn]
        s = g
        while s > 0 and groups[s - 1].turn == turn:
            s -= 1
        a = None
        for h in range(s, len(groups)):
            if groups[h].turn != turn:
                break
            if groups[h].is_user:
                a = h
                break
        self.anchors[turn] = a
        return a

    def with_anchor(self, g: int) -> list[int] | None:
        """A group and the user message that opens its turn (kept history must
        start each turn with its user message); None if that message is dropped."""
        a = self.anchor(g)
        if a is None or a == g:
            return [g]
        d = self.decision[a]
        if d is None:
            return [a, g]
        return [g] if d[0] == KEEP else None

    @property
    def current_turn(self) -> int:
        return self.conv.n_turns


def caps(lim: Limits) -> tuple[int, int, int]:
    """The state's max_tokens, max_chars, max_messages under `lim` (no limit: a number
    no sum reaches, so `State.fits` compares without a branch)."""
    return (
        _NO_LIMIT if lim.max_tokens is None else lim.max_tokens,
        _NO_LIMIT if lim.max_chars is None else lim.max_chars,
        _NO_LIMIT if lim.max_messages is None else lim.max_messages,
    )


def start_state(
    conv: Conversation, rules: PlanRules, lim: Limits, tokens_of: Callable[[int], int],
    overhead_tokens: int, tokens_key: Any, group_tokens: list[int] | None = None,
    cuttable: Container[int] = (),
) -> State:
    """A plan's state under `lim` before any stage: the system part and the current turn
    kept (the floor); `group_tokens`: counts an earlier run made. `cuttable`: messages of
    the current turn that the budget counts as history all the same (tool results the
    caller may compact: they are what can be cut of a long agent turn)."""
    groups = conv.groups
    st = State(
        conv=conv,
        rules=rules,
        tokens_of=tokens_of,
        count_tokens=rules.limits.max_tokens is not None,
        decision=[None] * len(groups),
        group_tokens=[-1] * len(groups) if group_tokens is None else group_tokens,
        max_turns=lim.max_turns,
        tokens_key=tokens_key,
    )
    # system/developer and the current turn are not subject to eviction
    st.messages_used = len(conv.fixed)
    fixed_chars = conv.outside_chars + sum(conv.text_chars[i] for i in conv.fixed)
    st.chars_used = fixed_chars
    fixed_tokens = (
        overhead_tokens + sum(tokens_of(i) for i in conv.fixed) if st.count_tokens else 0
    )
    st.tokens_used = fixed_tokens
    first_current = len(groups)
    first_turn = conv.first_current_turn
    while first_current and groups[first_current - 1].turn >= first_turn:
        first_current -= 1
    st.first_current = first_current
    current = range(first_current, len(groups))
    st.keep(current, "current")
    cut_tokens = cut_chars = 0
    if cuttable:
        for g in current:
            for i in groups[g].indices:
                if i in cuttable:
                    cut_tokens += tokens_of(i) if st.count_tokens else 0
                    cut_chars += conv.text_chars[i]
    st.floor_tokens, st.floor_chars = st.tokens_used - cut_tokens, st.chars_used - cut_chars
    st.set_caps(lim)
    return st
