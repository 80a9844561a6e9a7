"""The recent-turns stage: `keep_recent_turns` drops the turns older than the last
max_turns (moved in steps with low_water < 1, so the forwarded prefix holds still). It
reads no token or character budget."""

from __future__ import annotations

import bisect
import itertools
import math

from gateway.policy.state import DROP, KEEP, State, mark_of


def keep_recent_turns(st: State) -> None:
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
    mark = mark_of(DROP, "recent_turns")
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
