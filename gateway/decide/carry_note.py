"""The carry note of one request: built from the session's snapshot and the recalled
records, and the room it takes of the budget.

When history is dropped, the carry-over fold (resumed along the session) makes a
snapshot of what later turns still need; the note carrying it (and any recalled
records) is forwarded before the current turn and counted into every budget limit.
No I/O, no logging.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gateway.config.schema import CarryRules, Rules
from gateway.decide.decision import Decision
from gateway.decide.retrieve import hist_line
from gateway.policy import PlanRules
from gateway.policy.carry import Fold, render_note
from gateway.policy.carry.note import DEFAULT_NOTE


def note_room(
    d: Decision, rules: Rules, items: list[Any], recalled: list[str] | None
) -> Callable[[], tuple[int, int, int]]:
    """What the carry note takes of the budget (tokens, chars, messages), for the planner
    to ask once its stages have dropped history: the note is built then (from the whole
    history and the records recalled, not from what was dropped), so the fill leaves it
    room and the plan does not run again for it (it did on most cut requests: the fill
    leaves no slack). The stable part is planned under the budget without the note, so
    the note's length does not move the cut."""
    def room() -> tuple[int, int, int]:
        if not d.noted:
            carry_note(d, rules, items, recalled, dropped=True)
        return d.note_cost() if d.note is not None else (0, 0, 0)
    return room


def carry_note(
    d: Decision, rules: Rules, items: list[Any], recalled: list[str] | None,
    dropped: bool | None = None,
) -> bool:
    """Build the session's snapshot and the note that carries it (with any recalled
    records); True if there is a note. `dropped`: whether history is dropped (by default
    what the plan says)."""
    carry, patterns = rules.memory.carry, rules.memory.carry_patterns
    if d.conv is None:
        return False
    d.noted = True
    if dropped is None:
        dropped = d.plan is not None and bool(d.plan.dropped)
    if carry.enabled and patterns is not None and dropped:
        d.snapshot = _fold(d, items, patterns, carry).snapshot(carry, d.conv.groups[-1].turn,
                                                        skipped=carry.log_skipped)
    template = patterns.note if patterns is not None else DEFAULT_NOTE
    d.recalled = list(recalled or [])
    line = hist_line(d, rules.memory.retrieve.tool_name) if dropped else None
    d.note = render_note(d.snapshot, template, carry.max_note_chars, d.recalled, line)
    return d.note is not None


def minus_note(prules: PlanRules, d: Decision) -> PlanRules:
    """The plan's rules with the carry note's cost taken off every budget limit."""
    lim = prules.limits
    tokens, chars, messages = d.note_cost()
    return replace(prules, limits=replace(
        lim,
        max_tokens=None if lim.max_tokens is None else max(1, lim.max_tokens - tokens),
        max_chars=None if lim.max_chars is None else max(1, lim.max_chars - chars),
        max_messages=None if lim.max_messages is None else max(1, lim.max_messages - messages),
    ))


def _fold(d: Decision, items: list[Any], patterns: Any, carry: CarryRules) -> Fold:
    """The carry-over fold over every grouped message, resumed from the session's
    previous request when its history is unchanged up to where that fold stopped;
    checkpointed at this request's last turn start for the next one."""
    assert d.conv is not None
    view, wire = d.view, d.wire
    fold, start = Fold(patterns), 0
    prev = view.prev if view is not None else None
    if (prev is not None and prev.fold is not None and prev.fold.p is patterns
            and view is not None and view.known >= prev.start):
        # taken over, not copied: this request's entry replaces the previous one (a
        # concurrent request of the session finds none and folds from the start)
        fold, start, prev.fold = prev.fold, prev.start, None
    entry = view.entry if view is not None else None
    pause = entry.start if entry is not None and entry.start >= start else None
    turn_of: dict[int, int] = {}
    for g in reversed(d.conv.groups):  # groups are in index order: only the new ones
        if g.indices[-1] < start:
            break
        for i in g.indices:
            if i >= start:
                turn_of[i] = g.turn
    for i in sorted(turn_of):
        if pause is not None and i >= pause:
            assert entry is not None
            fold.prune(carry, turn_of[i])  # what this request's snapshot and later ones need
            entry.fold, pause = fold.copy(), None
        fold.add_text(turn_of[i], wire.item_role(items[i]), wire.item_text(items[i]))
        calls = wire.item_calls(items[i])  # an agent's tool calls: what they touched
        if calls:
            fold.add_calls(turn_of[i], calls)
    if pause is not None and entry is not None:
        entry.fold = fold  # nothing more is folded into it here: the snapshot only reads
    return fold
