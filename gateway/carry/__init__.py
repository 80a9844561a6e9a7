"""Long-memory carry-over: per-turn fields, the minimal snapshot, the injected note."""

from .rules import CarryPatterns, load_carry_patterns
from .snapshot import CarryRules, Fold, Message, Snapshot, build_snapshot, render_note

__all__ = [
    "CarryPatterns",
    "CarryRules",
    "Fold",
    "Message",
    "Snapshot",
    "build_snapshot",
    "load_carry_patterns",
    "render_note",
]
