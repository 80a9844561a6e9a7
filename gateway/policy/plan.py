"""The eviction planner: a loop over the configured stages, returning a `Plan`.

Pure: no I/O, no logging, no globals. Token counts come from a callable the
caller passes in (message index -> tokens), called only for what a decision
needs, so a history that clearly fits is never tokenized on the request path.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.measure.conversation import Conversation, Group, is_active
from gateway.policy import fill

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
    low_water: float = 1.0  # 1.0 = cut just under the budget (a sliding window)
    # when history is dropped: the share of the budget held back from the stable part
    # and filled with the dropped groups the current request is about (0 = off)
    recall_share: float = 0.0
    # MEMGATE_SHORTCUTS_OFF (Rules.shortcuts_off): the planner's own are PLAN_SHORTCUTS;
    # with one off its work is done the long way, with the same decisions
    shortcuts_off: frozenset[str] = frozenset()


# The planner's request-path shortcuts (names in MEMGATE_SHORTCUTS_OFF, README table):
# planpass: the stages that read no budget (pinned, recent_turns) run once for both
#   passes of a recall plan, and the full-budget pass is skipped when they already drop
# plancache: an unchanged history with the same floor (system + current turn) gets the
#   stable part's decision from the conversation's memo instead of the stages
# recallscan: the fill tests "dropped?" on a set, and the dropped runs around recalled
#   groups are found with list.index instead of a walk over every group
PLAN_SHORTCUTS = ("planpass", "plancache", "recallscan")


class Dropped(Sequence[tuple[int, str]]):
    """(message index, stage that dropped it), ascending: runs of dropped groups, listed
    only when read item by item. A long history drops thousands of messages on every
    request and most readers only count them or ask whether there are any."""

    __slots__ = ("_groups", "_items", "_n", "_runs")

    def __init__(self, groups: Sequence[Group] = (), runs: Sequence[tuple[int, int, str]] = (),
                 n: int = 0) -> None:
        self._groups, self._runs, self._n = groups, runs, n  # runs: (first, end, stage)
        self._items: tuple[tuple[int, str], ...] | None = None if n else ()

    def _list(self) -> tuple[tuple[int, str], ...]:
        if self._items is None:
            groups = self._groups
            self._items = tuple((i, stage) for a, b, stage in self._runs
                                for g in range(a, b) for i in groups[g].indices)
        return self._items

    def covers(self, g: int) -> bool:
        """Was group g dropped? (a binary search over the runs, nothing listed)"""
        runs = self._runs
        k = bisect.bisect_right(runs, g, key=lambda r: r[0]) - 1
        return k >= 0 and g < runs[k][1]

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def spans(self) -> list[tuple[int, int, str]]:
        """(first message, last message, stage) per run, nothing listed: a span also
        holds the fixed (system) messages between its groups, which are kept."""
        g = self._groups
        return [(g[a].indices[0], g[b - 1].indices[-1], stage) for a, b, stage in self._runs]

    def __getitem__(self, k: Any) -> Any:
        return self._list()[k]

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Dropped | tuple):
            return self._list() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._list())

    def __repr__(self) -> str:
        return repr(self._list())


@dataclass(frozen=True, slots=True)
class Plan:
    kept: tuple[int, ...]
    dropped: Dropped  # (message index, stage that dropped it), ascending
    kept_by: tuple[str, ...]  # parallel to kept: system | current | <stage> | unbudgeted
    pinned: int  # pinned messages kept
    pinned_overflow: int  # pinned messages beyond max_pinned (not protected)
    over_budget: bool
    kept_tokens: int | None  # None when the decision needed no token count
    kept_chars: int
    # low_water < 1 but no checkpoint's tail fitted (system + pins + the current turn take
    # more than the low-water share): the cut fell back to a newest-first fill
    fill_fallback: bool = False
    evict: str = "none"  # the stage that dropped most messages, or 'none'
    # dropped history brought back for the current request (in kept too): forwarded
    # after the stable part, before the current turn (fill.forward_order)
    recalled: tuple[int, ...] = ()
    recalled_tokens: int = 0


def _dominant_stage(counts: dict[str, int]) -> str:
    """The stage that dropped most messages (ties: the first by name), or 'none'."""
    if not counts:
        return "none"
    return max(sorted(counts), key=lambda s: counts[s])


_NO_LIMIT = 1 << 62
_MARKS: dict[tuple[str, str], tuple[str, str]] = {}  # (KEEP|DROP, stage) -> its mark


def _mark(kind: str, stage: str) -> tuple[str, str]:
    """One decision mark object per kind and stage: the plan finds runs of drops by
    identity (and no mark is allocated per decision)."""
    mark = _MARKS.get((kind, stage))
    if mark is None:
        mark = _MARKS[kind, stage] = (kind, stage)
    return mark


Cost = tuple[int, int, int]  # tokens, chars, messages


@dataclass(slots=True)
class _State:
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
        mark = _mark(KEEP, stage)
        for g in gs:
            decision[g] = mark
        self.tokens_used += t
        self.chars_used += c
        self.messages_used += m

    def drop(self, g: int, stage: str) -> None:
        if self.decision[g] is None:
            self.decision[g] = _mark(DROP, stage)

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


Stage = Callable[[_State], None]


def keep_pinned(st: _State) -> None:
    """Reserve pinned groups (up to max_pinned pinned messages), with their turn's user message."""
    if not st.rules.keep_pinned:
        return
    cur = st.current_turn
    ranked: list[tuple[tuple[int, float, int], int]] = []
    n_active: dict[int, int] = {}
    groups, decision = st.conv.groups, st.decision
    for g in [g for g in st.conv.pinned_groups if decision[g] is None]:
        grp = groups[g]
        active = [
            p for _, p in grp.pins if is_active(p, grp.turn, cur, st.rules.min_score)
        ]
        if active:
            n_active[g] = len(active)
            best = max(
                (int(p.explicit), p.score if p.score is not None else 0.0, g) for p in active
            )
            ranked.append((best, g))
    ranked.sort(reverse=True)
    budget = st.rules.max_pinned
    for _, g in ranked:
        if st.decision[g] is not None:  # already kept as the user message of a pinned group
            continue
        gs = st.with_anchor(g)
        # a pinned user message kept as the anchor counts against max_pinned too
        cost = sum(n_active.get(h, 0) for h in gs if st.decision[h] is None) if gs else 0
        if gs is not None and cost <= budget:
            budget -= cost
            st.keep(gs, "pinned")
        else:
            st.pinned_overflow += n_active[g]


def keep_recent_turns(st: _State) -> None:
    """Hard cap: turns older than the last max_turns are dropped.

    With low_water < 1 the cap moves in steps of (1 - low_water) * max_turns
    turns, so the oldest kept turn (and the forwarded prefix) stays the same
    for several requests instead of sliding by one turn each time.
    """
    limit = st.max_turns
    if limit is None:
        return
    need = st.current_turn - limit + 1  # the oldest turn the cap allows
    if need <= 1:  # turn 0 (before any user message) goes only with turn 1
        return
    step = max(1, math.ceil((1.0 - st.rules.low_water) * limit))
    oldest_allowed = 1 + step * math.ceil((need - 1) / step)
    decision = st.decision
    # groups are in turn order: the first k are the turns the cap drops
    k = bisect.bisect_left(st.conv.groups, oldest_allowed, key=lambda grp: grp.turn)
    mark = _mark(DROP, "recent_turns")
    if not any(decision[:k]):
        decision[:k] = [mark] * k
        st.dropped_prefix = (k, "recent_turns")
        st.capped = (k, ())
    elif "recallscan" in st.rules.shortcuts_off:  # some kept by an earlier stage (pins)
        decision[:k] = [mark if d is None else d for d in decision[:k]]
    else:  # the few an earlier stage decided found at C speed, the rest dropped at once
        head = decision[:k]
        decided = list(itertools.compress(range(k), head))
        decision[:k] = [mark] * k
        for g in decided:
            decision[g] = head[g]
        if all((d := head[g]) is not None and d[0] == KEEP for g in decided):
            st.capped = (k, tuple(decided))


def fit_length_budget(st: _State) -> None:
    """Newest first, keep what fits the token/char/message budget; drop the rest."""
    groups = st.conv.groups
    if st.rules.drop_unit == "group":
        _fit_groups(st)
        return
    by_turn: dict[int, list[int]] = {}
    decision = st.decision
    try:  # what earlier stages decided is often a long prefix (the recent-turns cap)
        first = decision.index(None, st.capped[0])
    except ValueError:
        first = len(decision)
    for g in range(first, len(groups)):
        if decision[g] is None:
            by_turn.setdefault(groups[g].turn, []).append(g)
    turns = sorted(by_turn, reverse=True)
    cut = _stepped_cut(st, by_turn) if st.rules.low_water < 1.0 and turns else None
    st.fill_fallback = st.rules.low_water < 1.0 and bool(turns) and cut is None
    full = False
    drop = _mark(DROP, "length")
    for turn in turns:
        gs = by_turn[turn]  # all undecided: their cost is the turn's
        if cut is not None:
            if turn >= cut:
                st.keep_open(gs, "length", st.turn_cost(turn, gs))
                continue
            full = True
        if not full and st.fits(cost := st.turn_cost(turn, gs)):
            st.keep_open(gs, "length", cost)
            continue
        full = True  # contiguous recency: nothing older than a turn that did not fit
        for g in gs:  # undecided (st.drop without a call per group: a long history
            decision[g] = drop  # drops thousands, twice with the fill)


def _stepped_cut(st: _State, by_turn: dict[int, list[int]]) -> int | None:
    """The first turn to keep, chosen among fixed checkpoints of the history.

    Checkpoints sit every (1 - low_water) of the budget along the history, measured
    from its start in what the budget counts (tokens as the planner counts them,
    characters, messages), so they do not move as turns are appended. The cut is the
    earliest checkpoint whose tail fits; it stays put until the tail no longer fits,
    then jumps to the next checkpoint, one step later, leaving the history near the
    low-water mark: one prefix change per step of growth. Recomputed from the history
    alone, the same cut comes back after a restart or on another replica.
    """
    checkpoints = _checkpoints(st, st.first_current, 1.0 - st.rules.low_water)
    if checkpoints is None:
        return None
    # newest checkpoint first: the tail only grows, so stop at the first that does not
    # fit
    is_checkpoint = set(checkpoints)
    best: int | None = None
    t_sum = c_sum = m_sum = 0
    newest = max(max(by_turn), max(checkpoints))
    lowest = min(by_turn)
    for turn in range(newest, lowest - 1, -1):
        gs = by_turn.get(turn)
        if gs is not None:
            t, c, m = st.turn_cost(turn, gs)
            t_sum, c_sum, m_sum = t_sum + t, c_sum + c, m_sum + m
        if turn in is_checkpoint:
            if not st.fits((t_sum, c_sum, m_sum)):
                break
            best = turn
    else:
        # older turns add nothing (an earlier stage decided them): every older checkpoint
        # fits exactly when this tail does, and the oldest of them is the earliest
        if checkpoints[0] < lowest and st.fits((t_sum, c_sum, m_sum)):
            best = checkpoints[0]
    return best


def _checkpoints(st: _State, end: int, step: float) -> list[int] | None:
    """The turns where checkpoints sit, over groups[:end] (None: no group).

    Each limited measure (tokens as the planner counts them, characters, messages) is
    summed along the history; a checkpoint sits at the first turn that starts a step
    ((1 - low_water) of the measure's limit) or more past the previous checkpoint in
    some measure. The measure that came a step keeps its grid (its next checkpoint is
    due at the next multiple of the step, so turn boundaries do not add up); the others
    count from the checkpoint. So no measure grows by more than a step (and a turn)
    between checkpoints, and with one measure limited (or one that binds throughout) a
    cut that jumps one checkpoint frees a step of it on average. Counting tokens means
    the history before the current turn is tokenized once (then only its new turns).
    Each checkpoint is a function of the turns before it: the checkpoints of a history
    are a prefix of those of the history grown.

    Resumed from the conversation's memo (shared along a session's growing history,
    see history.join) at the last turn boundary it recorded, when the groups before it
    are still the same: a growing session counts only its new turns."""
    conv = st.conv
    groups = conv.groups
    if not end:
        return None
    limits = st.rules.limits
    mt = limits.max_tokens if st.count_tokens else None
    mc, mm = limits.max_chars, limits.max_messages
    steps = tuple(step * cap if cap is not None else math.inf for cap in (mt, mc, mm))
    # counts are shared only under the name of what counted them (see plan())
    key = ("checkpoints", mt, mc, mm, step, st.tokens_key if mt is not None else None)
    shared = mt is None or st.tokens_key is not None
    memo = conv.memo.get(key) if shared else None
    start = 0
    # per measure: its sum, where it last counted from, the steps come since then
    offsets, bases, came = [0, 0, 0], [0, 0, 0], [0, 0, 0]
    checkpoints = [groups[0].turn]  # cutting nothing
    if memo is not None:
        n, prefix, m_offsets, m_bases, m_came, m_checkpoints = memo
        if n < end and groups[:n] == prefix:
            start, checkpoints = n, list(m_checkpoints)
            offsets, bases, came = list(m_offsets), list(m_bases), list(m_came)
    last_turn = groups[end - 1].turn
    turn = groups[start].turn
    t = c = m = 0  # the turn's sizes so far
    for g in range(start, end + 1):
        grp = groups[g] if g < end else None
        if grp is None or grp.turn != turn:  # the turn before g is complete
            if turn == last_turn and shared:  # remember the state before the newest turn
                n = g
                while n > start and groups[n - 1].turn == turn:
                    n -= 1
                if len(conv.memo) > 4:  # budgets of replaced rules or other models
                    conv.memo.clear()
                conv.memo[key] = (n, groups[:n], tuple(offsets), tuple(bases), tuple(came),
                                  tuple(checkpoints))
            levels = [math.floor((o - b) / s) for o, b, s in zip(offsets, bases, steps,
                                                                 strict=True)]
            if any(lv > done for lv, done in zip(levels, came, strict=True)):
                checkpoints.append(turn)
                for k in range(3):
                    if levels[k] > came[k]:  # this measure came a step: it keeps its grid
                        came[k] = levels[k]
                    else:  # the others count from here
                        bases[k], came[k] = offsets[k], 0
            offsets[0] += t
            offsets[1] += c
            offsets[2] += m
            if grp is None:
                break
            turn, t, c, m = grp.turn, 0, 0, 0
        if mt is not None:
            t += st.tokens(g)
        c += grp.chars
        m += len(grp.indices)
    return checkpoints


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
    for g in st.conv.pinned_groups:  # scores are pins
        grp = st.conv.groups[g]
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


def _caps(lim: Limits) -> tuple[int, int, int]:
    return (
        _NO_LIMIT if lim.max_tokens is None else lim.max_tokens,
        _NO_LIMIT if lim.max_chars is None else lim.max_chars,
        _NO_LIMIT if lim.max_messages is None else lim.max_messages,
    )


def _share(lim: Limits, share: float) -> Limits:
    def part(n: int | None) -> int | None:
        return None if n is None else max(1, int(n * share))

    # every limit, max_turns too: recalled groups open turns of their own
    return Limits(part(lim.max_tokens), part(lim.max_chars), part(lim.max_messages),
                  part(lim.max_turns))


def _start(
    conv: Conversation, rules: PlanRules, lim: Limits, tokens_of: Callable[[int], int],
    overhead_tokens: int, tokens_key: Any, group_tokens: list[int] | None = None,
) -> _State:
    """A plan's state under `lim` before any stage: the system part and the current turn
    kept (the floor); `group_tokens`: counts an earlier run made."""
    groups = conv.groups
    max_tokens, max_chars, max_messages = _caps(lim)
    st = _State(
        conv=conv,
        rules=rules,
        tokens_of=tokens_of,
        count_tokens=rules.limits.max_tokens is not None,
        decision=[None] * len(groups),
        group_tokens=[-1] * len(groups) if group_tokens is None else group_tokens,
        max_tokens=max_tokens,
        max_chars=max_chars,
        max_messages=max_messages,
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
    return st


def _run_stages(
    conv: Conversation, rules: PlanRules, lim: Limits, tokens_of: Callable[[int], int],
    overhead_tokens: int, tokens_key: Any, group_tokens: list[int] | None = None,
) -> _State:
    """The configured stages under `lim`; `group_tokens`: counts an earlier run made."""
    st = _start(conv, rules, lim, tokens_of, overhead_tokens, tokens_key, group_tokens)
    for name in rules.order:
        STAGES[name](st)
    return st


def _drops(st: _State) -> bool:
    """Did a stage drop anything? (a C-level search for each drop mark: every decision
    is one of the _MARKS objects)"""
    k, kept = st.capped
    if st.dropped_prefix[0] or k > len(kept):
        return True
    decision = st.decision
    return any(m in decision for (kind, _), m in list(_MARKS.items()) if kind == DROP)


# stages whose decisions read no budget: the same under any limits (pinned keeps up to
# max_pinned pins whatever they cost, recent_turns counts turns)
_BUDGET_FREE = frozenset({"pinned", "recent_turns"})


def _fork(st: _State, lim: Limits, turn_costs: dict[int, Cost]) -> _State:
    """A copy of st to run the remaining stages on under `lim` (the token counts and the
    turns' anchors, facts of the history, are shared)."""
    max_tokens, max_chars, max_messages = _caps(lim)
    return _State(
        conv=st.conv, rules=st.rules, tokens_of=st.tokens_of, count_tokens=st.count_tokens,
        decision=list(st.decision), tokens_used=st.tokens_used, chars_used=st.chars_used,
        messages_used=st.messages_used, anchors=st.anchors, group_tokens=st.group_tokens,
        pinned_overflow=st.pinned_overflow, fill_fallback=st.fill_fallback,
        max_tokens=max_tokens, max_chars=max_chars, max_messages=max_messages,
        max_turns=lim.max_turns, first_current=st.first_current,
        dropped_prefix=st.dropped_prefix, capped=st.capped, turn_costs=turn_costs,
        tokens_key=st.tokens_key,
    )


def _stages(base: _State, lim: Limits, stable: Limits, recall: bool, overhead_tokens: int
            ) -> tuple[_State, bool]:
    """The stable part: (the state the stages left, whether the fill runs on it). With
    `recall`, the stages run under `lim` and, if that drops, again under `stable` (the
    fill then has the rest). `base` is _start's state under `lim`."""
    conv, rules = base.conv, base.rules
    order = rules.order
    if "planpass" in rules.shortcuts_off:  # both passes from the start
        st = _run_stages(conv, rules, lim, base.tokens_of, overhead_tokens, base.tokens_key)
        if not (recall and _drops(st)):
            return st, False
        return _run_stages(conv, rules, stable, base.tokens_of, overhead_tokens,
                           base.tokens_key, st.group_tokens), True
    # recent_turns reads the turn cap, which the stable part has its share of
    free = _BUDGET_FREE if lim.max_turns == stable.max_turns else {"pinned"}
    k = 0
    while k < len(order) and order[k] in free:
        k += 1
    for name in order[:k]:  # once for both passes
        STAGES[name](base)
    rest = order[k:]
    if recall and _drops(base):  # the full-budget pass drops what these did: skipped
        base.max_tokens, base.max_chars, base.max_messages = _caps(stable)
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


def _planned(base: _State, lim: Limits, stable: Limits, recall: bool, overhead_tokens: int
             ) -> tuple[_State, bool]:
    """_stages, or what it gave for the same history (the same group objects: a session's
    unchanged history, history.join), the same floor and rules, from the conversation's
    memo: the stable part is a function of those alone (the fill, which reads the
    current request's words, is not memoized)."""
    rules, conv, fc = base.rules, base.conv, base.first_current
    if "plancache" in rules.shortcuts_off or base.tokens_key is None or not fc:
        return _stages(base, lim, stable, recall, overhead_tokens)
    groups = conv.groups
    key = (rules, base.tokens_key, conv.n_turns, recall, base.tokens_used, base.chars_used,
           base.messages_used)
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
            base.max_tokens, base.max_chars, base.max_messages = _caps(stable)
            base.max_turns = stable.max_turns
        return base, fill
    st, fill = _stages(base, lim, stable, recall, overhead_tokens)
    if len(entries) >= _STABLE_ENTRIES:
        entries.clear()
    entries[key] = (st.decision[:fc], st.group_tokens[:fc], st.tokens_used, st.chars_used,
                    st.messages_used, st.pinned_overflow, st.fill_fallback, st.dropped_prefix,
                    st.capped, fill)
    return st, fill


# the fill stops after this many candidates in a row that did not fit: the budget is
# as good as full, and every candidate tried is one more message to count
_FILL_MISSES = 32


@dataclass(frozen=True, slots=True)
class _Eligible:
    """The groups the fill may bring back: dropped, of a complete turn (not turn 0, not
    the current one). A membership test per group the query matches, not a set of the
    whole dropped history built on every request."""

    st: _State
    end: int
    marked: frozenset[int] = frozenset()

    def __contains__(self, g: object) -> bool:
        if not isinstance(g, int) or not 0 <= g < self.end or g in self.marked:
            return False
        d = self.st.decision[g]
        return d is not None and d[0] == DROP and self.st.conv.groups[g].turn > 0


def _cache_marked_groups(conv: Conversation, end: int) -> frozenset[int]:
    """The groups before `end` holding a message with a prompt-cache breakpoint. The fill
    leaves them dropped: moved after the stable prefix, a client's 1-hour breakpoint
    could follow a 5-minute one, which Anthropic refuses (1h entries must come first)."""
    held = (conv.group_of(i, end) for i in conv.cache_marked)
    return frozenset(g for g in held if g is not None)


def _eligible(st: _State, end: int, marked: frozenset[int]) -> Container[int]:
    """The fill's candidates (see _Eligible; not the `marked` groups) as a set, so that
    the ranking's many tests are C-level: the dropped prefix is a range, only the groups
    after it are read. Taken before the fill starts: a group it recalls stays in the
    set, and the fill passes it over as no longer dropped, as _Eligible would have left
    it out."""
    if "recallscan" in st.rules.shortcuts_off:
        return _Eligible(st, end, marked)
    groups, decision = st.conv.groups, st.decision
    lo = bisect.bisect_left(groups, 1, 0, end, key=lambda grp: grp.turn)  # past turn 0
    k, kept = st.capped
    k = min(k, end)
    out = set(range(lo, k))
    out.difference_update(kept)
    out.update(g for g in range(max(lo, k), end)
               if (d := decision[g]) is not None and d[0] == DROP)
    out.difference_update(marked)
    return out


def fill_from_request(st: _State, text_of: Callable[[int], str]) -> None:
    """Bring back dropped groups, most relevant to the current user message first (then
    the other dropped turns' opening messages), while they fit the whole budget; each
    comes with the user message that opens its turn (a group whose opening message the
    stable part kept stays dropped: forwarded after that part it would sit in a turn
    not its own)."""
    conv, decision = st.conv, st.decision
    groups = conv.groups
    end = st.first_current
    max_turns = st.rules.limits.max_turns
    turns = 0
    if max_turns is not None:  # the cap counts every forwarded turn, recalled ones too: the
        # stable part was planned under its (1 - recall_share) of them (_share), the fill
        # may open new turns up to the whole cap
        k, kept = st.capped  # groups[:k] dropped but `kept`: the rest is read
        turns = len({groups[g].turn for g in itertools.chain(kept, range(k, len(decision)))
                     if (d := decision[g]) is not None and d[0] == KEEP and groups[g].turn})
        if turns >= max_turns:
            # every candidate would open a turn (none is recalled yet), which the cap
            # refuses (a cap too small to share, or pins that fill it): nothing can come
            # back, so nothing is read or ranked
            return
    # what the newest user message asks (an input begun earlier, a document sent before
    # the question, is kept whole but does not word the query: LoCoMo dev, where the
    # question follows a user message, 80.0 / 88.2 / 93.1 -> 68.7 / 80.5 / 87.8 with it)
    last = conv.n_turns
    query = "\n".join(fill.group_text(groups[g], text_of) for g in range(end, len(groups))
                      if groups[g].is_user and groups[g].turn == last)
    if not query.strip():
        return
    idx = fill.index_history(conv, end, text_of)
    # the system part's terms are every request's: they say nothing about what to recall
    common = fill.common_terms("\n".join(text_of(i) for i in conv.fixed)) if conv.fixed else ()
    mark = _mark(KEEP, "recalled")
    marked = _cache_marked_groups(conv, end) if conv.cache_marked else frozenset()
    eligible = _eligible(st, end, marked)  # dropped groups of complete turns
    # the newest groups are kept: scoring reads no posting past the newest candidate
    below = next((g for g in range(end - 1, -1, -1) if g in eligible), -1) + 1
    ranked = fill.rank(idx, query, eligible, common, below)
    # then what was asked in the other dropped turns, newest first: a turn's opening
    # message is short and says what the turn was for (BFCL, 4k: +0.5 points of the
    # earlier user requests; LoCoMo: the ranked groups fill the budget before); walked
    # lazily, so a long history is read only as far as the budget lasts
    seen = set(ranked)
    openings = (g for g in range(end - 1, -1, -1)
                if groups[g].is_user and g in eligible and g not in seen)
    # before both, in at most 3/4 of the room: what was asked in the dropped turns that
    # called tools, newest first. Such a turn's opening message is short and says what
    # its results were for; ranked by their words, the results fill the room first and
    # the request rarely comes back (BFCL, 4k: earlier requests kept 93.1 -> 97.8%, the
    # bound of any policy; tool content 68.0 -> 67.4%; with half the room 97.0%). The
    # ranked groups keep a quarter of the room at least. A chat has no such turns.
    asked = _tool_turn_openings(st, eligible, (st.max_tokens - st.tokens_used) * 3 // 4)
    for candidates in (asked, ranked, openings):
        # each list stops on its own: ranked groups too big to fit do not starve the
        # short openings after them
        turns = _fill_with(st, candidates, mark, turns, marked)


def _tool_turn_openings(st: _State, eligible: Container[int], room: int) -> Iterator[int]:
    """The eligible opening groups of the turns before the current one that hold a tool
    call (a group of more than one message: the call and its results), newest first,
    while the fill has used less than `room` tokens since the first. Found from the
    tool groups (conv.tooled_groups): a chat that called a tool early is not walked."""
    groups, start = st.conv.groups, st.tokens_used
    tooled = st.conv.tooled_groups
    done = -1  # the turn whose openings were yielded last (turns come newest first)
    for k in range(bisect.bisect_left(tooled, st.first_current) - 1, -1, -1):
        h = tooled[k]  # the newest tool group of its turn: the user groups before it
        turn = groups[h].turn
        if turn == done:
            continue
        done = turn
        for g in range(h - 1, -1, -1):  # a turn's groups are contiguous
            grp = groups[g]
            if grp.turn != turn:
                break
            if grp.is_user and g in eligible:
                if st.tokens_used - start >= room:
                    return
                yield g


def _fill_with(st: _State, candidates: Iterable[int], mark: tuple[str, str], turns: int,
               marked: frozenset[int] = frozenset()) -> int:
    """Bring back the candidates (each with its turn's opening message, unless that is
    one of the `marked` groups) that fit, until _FILL_MISSES in a row did not; the
    number of turns kept after it."""
    decision, max_turns = st.decision, st.rules.limits.max_turns

    def dropped(g: int) -> bool:
        d = decision[g]
        return d is not None and d[0] == DROP

    misses = 0  # candidates in a row that did not fit
    for g in candidates:
        a = st.anchor(g)
        if a is None or not dropped(g):
            continue
        if decision[a] is mark:  # its turn is back already
            gs, new_turn = [g], False
        elif dropped(a) and a not in marked:
            gs, new_turn = ([g] if a == g else [a, g]), True
        else:
            continue
        if max_turns is not None and turns + new_turn > max_turns:
            continue
        cost = st.cost(gs)
        if not st.fits(cost):
            misses += 1
            if misses == _FILL_MISSES:
                break
            continue
        misses = 0
        for h in gs:
            decision[h] = mark
        st.tokens_used += cost[0]
        st.chars_used += cost[1]
        st.messages_used += cost[2]
        turns += new_turn
        if st.dropped_prefix[0] > gs[0]:  # no longer one dropped run
            st.dropped_prefix = (0, "")
    return turns


def plan(
    conv: Conversation,
    rules: PlanRules,
    tokens_of: Callable[[int], int],
    overhead_tokens: int = 0,
    tokens_upper_bound: int | None = None,
    tokens_key: Any = None,
    text_of: Callable[[int], str] | None = None,
    reserve: Callable[[], Cost] | None = None,
    tokens_exact: int | None = None,
) -> Plan:
    """Decide which messages to keep.

    `tokens_of(i)` gives message i's tokens; `overhead_tokens` is what the request
    pays besides messages (priming, tool schemas). `tokens_upper_bound`, when
    given, is a cheap bound on the total (e.g. the body size in bytes): if it and
    the other measures already fit, nothing is tokenized and nothing dropped.
    `tokens_key`, when given, names what `tokens_of` counts with (same key, same counts
    for the same messages): group sums are then kept on the groups for the next plan.
    `text_of(i)`, when given with a `recall_share`, gives message i's text: what the
    fill ranks dropped history by (see fill_from_request). `reserve()`, when given, is
    asked once the stages have dropped history, before the fill: what the caller will
    add to the request then (tokens, chars, messages: the carry note), which the fill
    leaves room for. `tokens_exact`, when given, is the total itself (what `tokens_of`
    sums to over every message, plus `overhead_tokens`; `tokens_upper_bound` is then at
    most that): the count a plan that keeps every message reports.

    A history that fits whole gets the same plan however that is known (by a bound, by
    the exact total, or by the stages keeping it all): every message kept as `fits`.
    """
    lim = rules.limits
    groups = conv.groups
    if fits_unplanned(conv, lim, tokens_upper_bound):
        return _fits_whole(conv, rules, tokens_exact)
    # with a recall share, once the stages drop under the whole budget: the stable part
    # gets what the share leaves, the fill the rest
    recall = text_of is not None and rules.recall_share > 0.0
    stable = _share(lim, 1.0 - rules.recall_share) if recall else lim
    base = _start(conv, rules, lim, tokens_of, overhead_tokens, tokens_key)
    st, fill = _planned(base, lim, stable, recall, overhead_tokens)
    capped = st.capped  # before the fill brings any of it back
    if fill:
        assert text_of is not None
        st.max_tokens, st.max_chars, st.max_messages = _caps(lim)
        if reserve is not None:
            tokens, chars, messages = reserve()
            st.max_tokens -= tokens
            st.max_chars -= chars
            st.max_messages -= messages
        fill_from_request(st, text_of)
    kept_groups: list[int] = []
    runs: list[tuple[int, int, str]] = []  # dropped groups [first, end) by one stage
    run_start, run_mark = 0, None
    skip, stage = st.dropped_prefix
    if skip:  # a long dropped prefix is one run, not a walk over its groups
        run_mark = _mark(DROP, stage)
    elif capped[0] and "recallscan" not in rules.shortcuts_off:
        # the groups the cap dropped, but those an earlier stage kept (pins) and those
        # the fill brought back (found by a search for its mark, not a walk over every
        # group): runs between them
        skip, stage = capped[0], "recent_turns"
        back, g = _mark(KEEP, "recalled"), -1
        apart = set(capped[1])
        while True:
            try:
                g = st.decision.index(back, g + 1, skip)
            except ValueError:
                break
            apart.add(g)
        for g in sorted(apart):
            if run_start < g:
                runs.append((run_start, g, stage))
            kept_groups.append(g)
            run_start = g + 1
        run_mark = _mark(DROP, stage) if run_start < skip else None
    for g in range(skip, len(groups)):
        d = st.decision[g]
        if d is not run_mark:
            if run_mark is not None:
                runs.append((run_start, g, run_mark[1]))
            run_start, run_mark = g, (d if d is not None and d[0] == DROP else None)
        if run_mark is None:
            kept_groups.append(g)
    if run_mark is not None:
        runs.append((run_start, len(groups), run_mark[1]))
    why = dict.fromkeys(conv.fixed, "system")
    decision = st.decision
    recalled: list[int] = []
    recalled_tokens = 0
    for g in kept_groups:
        d = decision[g]
        label = d[1] if d is not None else "unbudgeted"
        for i in groups[g].indices:
            why[i] = label
        if label == "recalled":
            recalled.extend(groups[g].indices)
            recalled_tokens += st.group_tokens[g]
    fixed = conv.fixed
    if fixed and kept_groups and fixed[-1] > groups[kept_groups[0]].indices[0]:
        kept: Sequence[int] = sorted(why)
        kept_by = tuple(map(why.__getitem__, kept))
    else:  # the system messages come first (as usual): already in index order
        kept, kept_by = tuple(why), tuple(why.values())
    drops: dict[str, int] = {}
    n_dropped = 0
    for a, b, stage in runs:
        n = _messages_in(conv, a, b)
        drops[stage] = drops.get(stage, 0) + n
        n_dropped += n
    dropped = Dropped(groups, runs, n_dropped)
    # what the stages kept is summed in st; groups no stage decided are kept too
    open_tokens, open_chars, _ = st.cost([g for g in kept_groups if st.decision[g] is None])
    kept_tokens = st.tokens_used + open_tokens
    kept_chars = st.chars_used + open_chars
    over = (
        (lim.max_tokens is not None and kept_tokens > lim.max_tokens)
        or (lim.max_chars is not None and kept_chars > lim.max_chars)
        or (lim.max_messages is not None and len(kept) > lim.max_messages)
    )
    if not runs and not over:
        return _fits_whole(conv, rules, kept_tokens if st.count_tokens else None)
    return Plan(
        kept=tuple(kept),
        dropped=dropped,
        kept_by=kept_by,
        pinned=_count_pins(conv, [g for g in conv.pinned_groups
                                  if (mark := decision[g]) is None or mark[0] == KEEP], rules),
        pinned_overflow=st.pinned_overflow,
        over_budget=over,
        kept_tokens=kept_tokens if st.count_tokens else None,
        kept_chars=kept_chars,
        fill_fallback=st.fill_fallback and bool(dropped),
        evict=_dominant_stage(drops),
        recalled=tuple(recalled),
        recalled_tokens=recalled_tokens if st.count_tokens else 0,
    )


def _fits_whole(conv: Conversation, rules: PlanRules, kept_tokens: int | None) -> Plan:
    """Every message kept: the history fits (`kept_tokens`: its count, when known)."""
    return Plan(
        kept=tuple(range(conv.n_messages)),
        dropped=Dropped(),
        kept_by=("fits",) * conv.n_messages,
        pinned=_count_pins(conv, conv.pinned_groups, rules),
        pinned_overflow=0,
        over_budget=False,
        kept_tokens=kept_tokens,
        kept_chars=conv.total_text_chars + conv.outside_chars,
    )


def _messages_in(conv: Conversation, a: int, b: int) -> int:
    """Messages in groups[a:b]: groups hold ascending, disjoint indices and, with the
    fixed messages, every index once; so the span minus the fixed messages inside it."""
    groups, fixed = conv.groups, conv.fixed
    lo, hi = groups[a].indices[0], groups[b - 1].indices[-1]
    return hi - lo + 1 - (bisect.bisect_right(fixed, hi) - bisect.bisect_left(fixed, lo))


def fits_unplanned(conv: Conversation, lim: Limits, bound: int | None) -> bool:
    """Does the whole history fit `lim`, `bound` being an upper bound of its tokens?"""
    if lim.max_turns is not None and conv.n_turns > lim.max_turns:
        return False
    if lim.max_messages is not None and conv.n_messages > lim.max_messages:
        return False
    if lim.max_chars is not None and conv.total_text_chars + conv.outside_chars > lim.max_chars:
        return False
    if lim.max_tokens is not None and (bound is None or bound > lim.max_tokens):
        return False
    return True


def _count_pins(conv: Conversation, groups: Sequence[int] | range, rules: PlanRules) -> int:
    cur = conv.n_turns
    n = 0
    for g in groups:
        grp: Group = conv.groups[g]
        if grp.pins:
            n += sum(1 for _, p in grp.pins if is_active(p, grp.turn, cur, rules.min_score))
    return n
