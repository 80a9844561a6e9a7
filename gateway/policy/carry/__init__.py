"""Long-memory carry-over: per-turn fields, the minimal snapshot, the injected note."""

from gateway.policy.carry.snapshot import Fold, Message, Snapshot, build_snapshot, render_note

__all__ = ["Fold", "Message", "Snapshot", "build_snapshot", "render_note"]
