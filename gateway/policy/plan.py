"""The eviction planner: a loop over the configured stages, returning a `Plan`.

Pure: no I/O, no logging, no globals. Token counts come from a callable the
caller passes in (message index -> tokens), called only for what a decision
needs, so a history that clearly fits is never tokenized on the request path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..conversation import Conversation, Group, is_active

KEEP = "keep"
DROP = "drop"


@dataclass(frozen=True, slots=True)
class Limits:
    """A concrete budget for one request (None = no limit on that measure)."""

    max_tokens: int | None = None
    max_chars: int | None = None
    max_messages: int | None = None
    max_turns: int | None = None


@dataclass(frozen=True, slots=True)
class PlanRules:
    limits: Limits
    order: tuple[str, ...] = ("pinned", "recent_turns", "length")
    keep_pinned: bool = True
    max_pinned: int = 8
    drop_unit: str = "turn"
    min_score: float = 0.7


@dataclass(frozen=True, slots=True)
class Plan:
    kept: tuple[int, ...]
    dropped: tuple[tuple[int, str], ...]  # (message index, stage that dropped it)
    kept_by: tuple[str, ...]  # parallel to kept: system | current | <stage> | unbudgeted
    pinned: int  # pinned messages kept
    pinned_overflow: int  # pinned messages beyond max_pinned (not protected)
    over_budget: bool
    kept_tokens: int | None  # None when the decision needed no token count
    kept_chars: int

    @property
    def evict(self) -> str:
        """The stage that dropped most messages, or 'none'."""
        if not self.dropped:
            return "none"
        counts: dict[str, int] = {}
        for _, stage in self.dropped:
            counts[stage] = counts.get(stage, 0) + 1
        return max(sorted(counts), key=lambda s: counts[s])


@dataclass(slots=True)
class _Totals:
    tokens: int = 0
    chars: int = 0
    messages: int = 0


@dataclass(slots=True)
class _State:
    conv: Conversation
    rules: PlanRules
    tokens_of: Callable[[int], int]
    count_tokens: bool
    decision: list[tuple[str, str] | None]  # per group: (KEEP|DROP, stage)
    totals: _Totals = field(default_factory=_Totals)
    turn_anchor: dict[int, int] = field(default_factory=dict)  # turn -> its user group
    group_tokens: dict[int, int] = field(default_factory=dict)
    pinned_overflow: int = 0

    def tokens(self, g: int) -> int:
        if not self.count_tokens:
            return 0
        n = self.group_tokens.get(g)
        if n is None:
            n = sum(self.tokens_of(i) for i in self.conv.groups[g].indices)
            self.group_tokens[g] = n
        return n

    def cost(self, gs: Sequence[int]) -> _Totals:
        groups = self.conv.groups
        return _Totals(
            tokens=sum(self.tokens(g) for g in gs),
            chars=sum(groups[g].chars for g in gs),
            messages=sum(len(groups[g].indices) for g in gs),
        )

    def fits(self, extra: _Totals) -> bool:
        lim, t = self.rules.limits, self.totals
        return (
            (lim.max_tokens is None or t.tokens + extra.tokens <= lim.max_tokens)
            and (lim.max_chars is None or t.chars + extra.chars <= lim.max_chars)
            and (lim.max_messages is None or t.messages + extra.messages <= lim.max_messages)
        )

    def keep(self, gs: Sequence[int], stage: str) -> None:
        add = self.cost([g for g in gs if self.decision[g] is None])
        for g in gs:
            if self.decision[g] is None:
                self.decision[g] = (KEEP, stage)
        self.totals.tokens += add.tokens
        self.totals.chars += add.chars
        self.totals.messages += add.messages

    def drop(self, g: int, stage: str) -> None:
        if self.decision[g] is None:
            self.decision[g] = (DROP, stage)

    def with_anchor(self, g: int) -> list[int] | None:
        """A group and the user message that opens its turn (kept history must
        start each turn with its user message); None if that message is dropped."""
        a = self.turn_anchor.get(self.conv.groups[g].turn)
        if a is None or a == g:
            return [g]
        d = self.decision[a]
        if d is None:
            return [a, g]
        return [g] if d[0] == KEEP else None

    @property
    def current_turn(self) -> int:
        return self.conv.n_turns


Stage = Callable[[_State], None]


def keep_pinned(st: _State) -> None:
    """Reserve pinned groups (up to max_pinned pinned messages), with their turn's user message."""
    if not st.rules.keep_pinned:
        return
    cur = st.current_turn
    ranked: list[tuple[tuple[int, float, int], int, int]] = []
    for g, grp in enumerate(st.conv.groups):
        if st.decision[g] is not None:
            continue
        active = [
            p for _, p in grp.pins if is_active(p, grp.turn, cur, st.rules.min_score)
        ]
        if active:
            best = max(
                (int(p.explicit), p.score if p.score is not None else 0.0, g) for p in active
            )
            ranked.append((best, g, len(active)))
    ranked.sort(reverse=True)
    budget = st.rules.max_pinned
    for _, g, n in ranked:
        gs = st.with_anchor(g)
        if n <= budget and gs is not None:
            budget -= n
            st.keep(gs, "pinned")
        else:
            st.pinned_overflow += n


def keep_recent_turns(st: _State) -> None:
    """Hard cap: turns older than the last max_turns are dropped."""
    limit = st.rules.limits.max_turns
    if limit is None:
        return
    oldest_allowed = st.current_turn - limit + 1
    if oldest_allowed <= 1:  # turn 0 (before any user message) goes only with turn 1
        return
    for g, grp in enumerate(st.conv.groups):
        if grp.turn < oldest_allowed:
            st.drop(g, "recent_turns")


def fit_length_budget(st: _State) -> None:
    """Newest first, keep what fits the token/char/message budget; drop the rest."""
    groups = st.conv.groups
    if st.rules.drop_unit == "group":
        _fit_groups(st)
        return
    by_turn: dict[int, list[int]] = {}
    for g, grp in enumerate(groups):
        if st.decision[g] is None:
            by_turn.setdefault(grp.turn, []).append(g)
    full = False
    for turn in sorted(by_turn, reverse=True):
        gs = by_turn[turn]
        if not full and st.fits(st.cost(gs)):
            st.keep(gs, "length")
            continue
        full = True  # contiguous recency: nothing older than a turn that did not fit
        for g in gs:
            st.drop(g, "length")


def _fit_groups(st: _State) -> None:
    groups = st.conv.groups
    per_turn: dict[int, int] = {}
    for grp in groups:
        per_turn[grp.turn] = per_turn.get(grp.turn, 0) + 1
    for g in range(len(groups) - 1, -1, -1):
        if st.decision[g] is not None:
            continue
        if groups[g].is_user and per_turn[groups[g].turn] > 1:
            # a user message whose replies were all dropped stays only if it is the whole turn
            st.drop(g, "length")
            continue
        gs = st.with_anchor(g)
        if gs is not None and st.fits(st.cost(gs)):
            st.keep(gs, "length")
        else:
            st.drop(g, "length")


def keep_by_score(st: _State) -> None:
    """Keep older scored groups by score, then recency, while they fit the budget."""
    scored: list[tuple[float, int]] = []
    for g, grp in enumerate(st.conv.groups):
        if st.decision[g] is None:
            scores = [p.score for _, p in grp.pins if p.score is not None]
            if scores:
                scored.append((max(scores), g))
    scored.sort(reverse=True)
    for _, g in scored:
        gs = st.with_anchor(g)
        if gs is not None and st.fits(st.cost(gs)):
            st.keep(gs, "score")


STAGES: dict[str, Stage] = {
    "pinned": keep_pinned,
    "recent_turns": keep_recent_turns,
    "length": fit_length_budget,
    "score": keep_by_score,
}


def plan(
    conv: Conversation,
    rules: PlanRules,
    tokens_of: Callable[[int], int],
    overhead_tokens: int = 0,
    tokens_upper_bound: int | None = None,
) -> Plan:
    """Decide which messages to keep.

    `tokens_of(i)` gives message i's tokens; `overhead_tokens` is what the request
    pays besides messages (priming, tool schemas). `tokens_upper_bound`, when
    given, is a cheap bound on the total (e.g. the body size in bytes): if it and
    the other measures already fit, nothing is tokenized and nothing dropped.
    """
    lim = rules.limits
    groups = conv.groups
    if _fits_without_planning(conv, lim, tokens_upper_bound):
        return Plan(
            kept=tuple(range(conv.n_messages)),
            dropped=(),
            kept_by=("fits",) * conv.n_messages,
            pinned=_count_pins(conv, range(len(groups)), rules),
            pinned_overflow=0,
            over_budget=False,
            kept_tokens=None,
            kept_chars=conv.total_chars,
        )
    st = _State(
        conv=conv,
        rules=rules,
        tokens_of=tokens_of,
        count_tokens=lim.max_tokens is not None,
        decision=[None] * len(groups),
    )
    for g, grp in enumerate(groups):
        if grp.is_user and grp.turn not in st.turn_anchor:
            st.turn_anchor[grp.turn] = g
    # system/developer and the current turn are not subject to eviction
    st.totals.messages = len(conv.fixed)
    st.totals.chars = sum(conv.chars[i] for i in conv.fixed)
    if st.count_tokens:
        st.totals.tokens = overhead_tokens + sum(tokens_of(i) for i in conv.fixed)
    current = [g for g, grp in enumerate(groups) if grp.turn == conv.n_turns]
    st.keep(current, "current")
    for name in rules.order:
        STAGES[name](st)
    kept_groups = [g for g, d in enumerate(st.decision) if d is None or d[0] == KEEP]
    why = dict.fromkeys(conv.fixed, "system")
    for g in kept_groups:
        d = st.decision[g]
        for i in groups[g].indices:
            why[i] = d[1] if d is not None else "unbudgeted"
    kept = sorted(why)
    dropped = sorted(
        (i, d[1])
        for g, d in enumerate(st.decision)
        if d is not None and d[0] == DROP
        for i in groups[g].indices
    )
    final = st.cost(kept_groups)
    fixed_tokens = (
        overhead_tokens + sum(tokens_of(i) for i in conv.fixed) if st.count_tokens else 0
    )
    kept_tokens = fixed_tokens + final.tokens
    kept_chars = final.chars + sum(conv.chars[i] for i in conv.fixed)
    over = (
        (lim.max_tokens is not None and kept_tokens > lim.max_tokens)
        or (lim.max_chars is not None and kept_chars > lim.max_chars)
        or (lim.max_messages is not None and len(kept) > lim.max_messages)
    )
    return Plan(
        kept=tuple(kept),
        dropped=tuple(dropped),
        kept_by=tuple(why[i] for i in kept),
        pinned=_count_pins(conv, kept_groups, rules),
        pinned_overflow=st.pinned_overflow,
        over_budget=over,
        kept_tokens=kept_tokens if st.count_tokens else None,
        kept_chars=kept_chars,
    )


def _fits_without_planning(conv: Conversation, lim: Limits, bound: int | None) -> bool:
    if lim.max_turns is not None and conv.n_turns > lim.max_turns:
        return False
    if lim.max_messages is not None and conv.n_messages > lim.max_messages:
        return False
    if lim.max_chars is not None and conv.total_chars > lim.max_chars:
        return False
    if lim.max_tokens is not None and (bound is None or bound > lim.max_tokens):
        return False
    return True


def _count_pins(conv: Conversation, groups: Sequence[int] | range, rules: PlanRules) -> int:
    cur = conv.n_turns
    n = 0
    for g in groups:
        grp: Group = conv.groups[g]
        n += sum(1 for _, p in grp.pins if is_active(p, grp.turn, cur, rules.min_score))
    return n
