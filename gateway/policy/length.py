"""The length stage: `fit_length_budget` keeps the newest turns (or groups) that fit the
token / character / message budget and drops the rest; with low_water < 1 the cut sits
on fixed checkpoints of the history (`checkpoint_turns`), so the forwarded prefix
changes once per step of growth, not on every request."""

from __future__ import annotations

import math

from gateway.policy.state import DROP, State, mark_of


def fit_length_budget(st: State) -> None:
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
    drop = mark_of(DROP, "length")
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


def _stepped_cut(st: State, by_turn: dict[int, list[int]]) -> int | None:
    """The first turn to keep, chosen among fixed checkpoints of the history.

    Checkpoints sit every (1 - low_water) of the budget along the history, measured
    from its start in what the budget counts (tokens as the planner counts them,
    characters, messages), so they do not move as turns are appended. The cut is the
    earliest checkpoint whose tail fits; it stays put until the tail no longer fits,
    then jumps to the next checkpoint, one step later, leaving the history near the
    low-water mark: one prefix change per step of growth. Recomputed from the history
    alone, the same cut comes back after a restart or on another replica.
    """
    checkpoints = checkpoint_turns(st, st.first_current, 1.0 - st.rules.low_water)
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


def checkpoint_turns(st: State, end: int, step: float) -> list[int] | None:
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


def _fit_groups(st: State) -> None:
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
