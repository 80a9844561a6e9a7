"""Long-memory carry-over: per-turn fields, the minimal snapshot, the injected note."""

from gateway.policy.carry.calls import ToolCall
from gateway.policy.carry.note import render_note
from gateway.policy.carry.snapshot import Fold, Message, Snapshot, build_snapshot

__all__ = ["Fold", "Message", "Snapshot", "ToolCall", "build_snapshot", "render_note"]
