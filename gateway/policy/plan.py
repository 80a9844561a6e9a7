"""The eviction planner: `plan()` decides which messages to keep and returns a `Plan`.

A history that fits whole is kept without a stage run; otherwise the stable part
(gateway.policy.stages) runs the configured stages, the recall fill
(gateway.policy.fill_stage) brings back what the request is about, and the decisions are
read into the `Plan` (kept, dropped runs, reasons, pins, over_budget). Pure: no I/O, no
logging, no globals. Token counts come from a callable the caller passes in (message
index -> tokens), called only for what a decision needs, so a history that clearly fits
is never tokenized on the request path."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.measure.conversation import Conversation, Group, is_active
from gateway.policy.fill_stage import fill_from_request
from gateway.policy.plan_rules import Limits, PlanRules
from gateway.policy.stages import stable_part
from gateway.policy.state import DROP, KEEP, Cost, mark_of, start_state


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
    # what the floor took (system part, tool schemas and priming, the current turn), on
    # top of which the token and character limits count (None / 0: a plan that keeps
    # everything, or one that counted no tokens)
    fixed_tokens: int | None = None
    fixed_chars: int = 0
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


def _share(lim: Limits, share: float) -> Limits:
    def part(n: int | None) -> int | None:
        return None if n is None else max(1, int(n * share))

    # every limit, max_turns too: recalled groups open turns of their own
    return Limits(part(lim.max_tokens), part(lim.max_chars), part(lim.max_messages),
                  part(lim.max_turns), lim.tokens_whole)


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
    cuttable: Container[int] = (),
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
    most that): the count a plan that keeps every message reports. `cuttable`: messages
    of the current turn the budget counts as history (tool results the caller compacts
    when the history is cut or over), not as the floor.

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
    base = start_state(conv, rules, lim, tokens_of, overhead_tokens, tokens_key,
                       cuttable=cuttable)
    st, fill = stable_part(base, lim, stable, recall, overhead_tokens, cuttable)
    capped = st.capped  # before the fill brings any of it back
    if fill:
        assert text_of is not None
        st.set_caps(lim)
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
        run_mark = mark_of(DROP, stage)
    elif capped[0] and "recallscan" not in rules.shortcuts_off:
        # the groups the cap dropped, but those an earlier stage kept (pins) and those
        # the fill brought back (found by a search for its mark, not a walk over every
        # group): runs between them
        skip, stage = capped[0], "recent_turns"
        back, g = mark_of(KEEP, "recalled"), -1
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
        run_mark = mark_of(DROP, stage) if run_start < skip else None
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
    floor_tokens = 0 if lim.tokens_whole else st.floor_tokens
    over = (  # the history could not be brought under the budget
        (lim.max_tokens is not None and kept_tokens - floor_tokens > lim.max_tokens)
        or (lim.max_chars is not None and kept_chars - st.floor_chars > lim.max_chars)
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
        fixed_tokens=st.floor_tokens if st.count_tokens else None,
        fixed_chars=st.floor_chars,
    )


def _fits_whole(conv: Conversation, rules: PlanRules, kept_tokens: int | None) -> Plan:
    """Every message kept: the history fits (`kept_tokens`: its count, when known). The
    same plan however the fit was found, so no floor: nothing was cut on top of it."""
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
    """Does the whole history fit `lim`, `bound` being an upper bound of its tokens?
    (The whole request under the history's limits: sound, since the floor, which the
    limits leave out, is part of it.)"""
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
