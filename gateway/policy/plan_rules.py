"""What the planner is told: a request's `Limits` (its budget) and the `PlanRules` (the
stage order and each stage's settings, the recall share, the shortcuts turned off), with
the names of the planner's request-path shortcuts. Frozen: one snapshot per request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    """A concrete budget for one request (None = no limit on that measure).

    The token and character limits count the history that can be cut: the floor the
    planner never cuts (system and developer messages, the client's opening context,
    tool schemas and priming, the current turn) comes on top, so a large fixed part
    never turns every cut into a wipe. With `tokens_whole` the token limit counts the
    whole request instead (a model's window: `max_tokens: auto`). The message and turn
    limits are caps on the whole forwarded request."""

    max_tokens: int | None = None
    max_chars: int | None = None
    max_messages: int | None = None
    max_turns: int | None = None
    tokens_whole: bool = False


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
