"""The budget-filling recall's part of a plan: `fill_from_request` brings dropped groups
back into the budget the stable part leaves free, those the current request is about
first (ranked by gateway.policy.fill), each with the user message opening its turn."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass

from gateway.measure.conversation import Conversation
from gateway.policy import fill
from gateway.policy.state import DROP, KEEP, State, mark_of

# the fill stops after this many candidates in a row that did not fit: the budget is
# as good as full, and every candidate tried is one more message to count
_FILL_MISSES = 32


@dataclass(frozen=True, slots=True)
class _Eligible:
    """The groups the fill may bring back: dropped, of a complete turn (not turn 0, not
    the current one). A membership test per group the query matches, not a set of the
    whole dropped history built on every request."""

    st: State
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


def _eligible(st: State, end: int, marked: frozenset[int]) -> Container[int]:
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


def fill_from_request(st: State, text_of: Callable[[int], str]) -> None:
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
        # stable part was planned under its (1 - recall_share) of them (plan._share), the fill
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
    mark = mark_of(KEEP, "recalled")
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


def _tool_turn_openings(st: State, eligible: Container[int], room: int) -> Iterator[int]:
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


def _fill_with(st: State, candidates: Iterable[int], mark: tuple[str, str], turns: int,
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
