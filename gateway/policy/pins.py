"""The stages that keep pinned groups: `keep_pinned` (the active pins, up to max_pinned of
them, whatever they cost) and `keep_by_score` (older scored groups, best score first,
while they fit the budget). Each kept group comes with the user message opening its turn."""

from __future__ import annotations

from gateway.measure.conversation import is_active
from gateway.policy.state import State


def keep_pinned(st: State) -> None:
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


def keep_by_score(st: State) -> None:
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
