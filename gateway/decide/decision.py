"""The decision made for one request, and the figures derived from it.

A `Decision` keeps what `decide` (chat.py) found: the body as the client sent it and as
it is forwarded, the parsed conversation, the plan, the carry note and the compacted
tool results; its methods count the request's tokens (per message, cached along the
session) and say where the kept items go. Read by the handler, the `[mem]` line,
recall and the CLI. No I/O, no logging.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.decide.history import View
from gateway.decide.splice import Splice
from gateway.measure.conversation import Conversation
from gateway.measure.tokens import TokenCounter
from gateway.policy import Plan
from gateway.policy.carry import Snapshot
from gateway.policy.fill import forward_order
from gateway.wire.base import Wire


@dataclass(slots=True)
class Decision:
    raw: bytes
    payload: Any
    wire: Wire
    mode: str
    model: str | None
    counter: TokenCounter
    forward: bytes  # `counter` counts text x tokens.approx_factor on an approx wire
    conv: Conversation | None = None
    plan: Plan | None = None
    skip_reason: str | None = None
    budget_tokens: int | None = None
    cache_marker_dropped: bool = False
    cache_marker_moved: bool = False
    snapshot: Snapshot | None = None
    note: str | None = None
    recalled: list[str] = field(default_factory=list)
    _items: list[Any] | None = None
    _overhead: int | None = None
    view: View | None = None  # what the session's history cache gave this request
    _msg_tokens: list[int] | None = None  # per message, -1 = not counted yet
    spliced_from: Splice | None = None  # the session's earlier body this one was parsed from
    bad_metadata: str | None = None  # why a memgate block was ignored (logged metadata=invalid)
    # compact_tools: per item, the (path, new text) of its compacted tool results, and
    # the item's tokens with them (the planner counts these instead)
    compacted: dict[int, list[tuple[Any, str]]] = field(default_factory=dict)
    compact_tokens: dict[int, int] = field(default_factory=dict)
    compact_chars: dict[int, int] = field(default_factory=dict)  # hist_chars' measure
    archived: dict[str, tuple[int, str]] = field(default_factory=dict)  # id -> (item, original)
    noted: bool = False  # the carry note was built (d.note: it, or None if there is none)
    # memory.retrieve: the tenant and session the handles are made for (None: the request
    # may not carry the retrieval tool; `retrieve_off` says why, when a rule forbids it),
    # the tool's name when the forwarded body carries it, and what its handles give back
    handles_in: str | None = None
    retrieve_off: str | None = None
    retrieve: str | None = None
    retrievable: dict[str, str] = field(default_factory=dict)  # cmp- handle -> original
    hist_handle: str | None = None  # the dropped turns' handle, when the note names it
    tool_tokens: int = 0  # the retrieval tool's definition, counted with the tool schemas

    @property
    def messages(self) -> list[Any]:
        """The history list eviction works on (`messages`, or Responses `input`)."""
        if self._items is None:
            items = self.wire.items(self.payload) if isinstance(self.payload, dict) else None
            self._items = items if items is not None else []
        return self._items

    def message_tokens(self, i: int) -> int:
        counts = self._msg_tokens
        if counts is None:
            counts = self._msg_tokens = [-1] * len(self.messages)
        n = counts[i]
        if n < 0:
            n = counts[i] = self.wire.item_tokens(self.messages[i], self.counter)
        return n

    def planned_tokens(self, i: int) -> int:
        """Item i's tokens as forwarded: compacted, or as the client sent it."""
        n = self.compact_tokens.get(i)
        return self.message_tokens(i) if n is None else n

    def compacted_kept(self) -> tuple[int, int]:
        """(kept items with a compacted tool result, the tokens that saved)."""
        if not self.compacted or self.plan is None:
            return 0, 0
        kept = [i for i in self.plan.kept if i in self.compact_tokens]
        return len(kept), sum(self.message_tokens(i) - self.compact_tokens[i] for i in kept)

    def overhead_tokens(self) -> int:
        if self._overhead is None:
            self._overhead = (self.wire.overhead_tokens(self.payload, self.counter)
                              + self.tool_tokens if isinstance(self.payload, dict) else 0)
        return self._overhead

    def note_cost(self) -> tuple[int, int, int]:
        """The carry note's tokens, chars and messages, as the budget counts them."""
        assert self.note is not None
        return self.counter.count_pieces((self.note, 4)), len(self.note), 1

    def placement(self) -> tuple[list[int], tuple[int, ...], int | None]:
        """(the kept items that stay where they are, ascending; the recalled ones, which
        move after them; the current turn's first item, which they go before). With no
        current turn nothing is asked, so nothing moves."""
        assert self.plan is not None
        current = current_turn_start(self.conv)
        moved = self.plan.recalled if current is not None else ()
        back = frozenset(moved)
        return [i for i in self.plan.kept if i not in back], moved, current

    def forwarded(self) -> list[int]:
        """The kept items in the order they are forwarded (recalled history moved after
        the stable part, before the current turn)."""
        stable, moved, current = self.placement()
        return forward_order(stable, moved, current) if moved and current is not None else stable

    def unchanged(self, reason: str) -> Decision:
        """This request as the client sent it: measured, not planned (`reason`: why)."""
        return replace(self, forward=self.raw, plan=None, skip_reason=reason, note=None,
                       snapshot=None, recalled=[], compacted={}, compact_tokens={},
                       compact_chars={}, archived={}, cache_marker_dropped=False,
                       cache_marker_moved=False, retrieve=None, retrievable={},
                       hist_handle=None, tool_tokens=0, _overhead=None)

    def kept_tokens(self) -> int:
        """Estimated tokens of the request with only the plan's kept messages (and the
        carry note, when one is forwarded)."""
        assert self.plan is not None
        note = self.note_cost()[0] if self.note is not None else 0
        return (self.overhead_tokens() + note
                + sum(self.planned_tokens(i) for i in self.plan.kept))

    def uncounted_chars(self) -> int:
        """Characters of the messages whose tokens the session's cache does not hold
        (an upper bound of what counting the whole history still has to tokenize)."""
        if self.conv is None:
            return 0
        known = self.view.known if self.view is not None else 0
        return sum(self.conv.text_chars[known:])  # media payloads are never tokenized

    def known_counted(self) -> bool:
        """Are the items the session's cache knows all counted? Not while a concurrent
        request of the session, or a body decided again, left gaps in those counts."""
        counts, known = self._msg_tokens, self.view.known if self.view is not None else 0
        return not known or (counts is not None and min(counts[:known]) >= 0)

    def reuse_counts(self) -> None:
        """Start from the previous request's counts of the unchanged items; share this
        request's counts with the next one."""
        view = self.view
        assert view is not None
        n = len(self.messages)
        token_key = self.counter  # one per encoding and factor (Tokenizers, scaled)
        prev = view.prev
        if prev is not None and prev.token_key is token_key and view.known:
            self._msg_tokens = prev.tokens[: view.known] + [-1] * (n - view.known)
        else:
            self._msg_tokens = [-1] * n
        if view.entry is not None:
            view.entry.tokens = self._msg_tokens
            view.entry.token_key = token_key

    async def count_off_loop(self, indices: list[int], executor: Executor | None = None) -> None:
        """Count these messages in a worker thread of `executor` (tiktoken releases the
        GIL): a cold megabyte history is not tokenized on the event loop."""
        items = self.messages
        if self._msg_tokens is None:
            self._msg_tokens = [-1] * len(items)
        todo = [i for i in indices if self._msg_tokens[i] < 0]
        if not todo:
            return
        # a private, uncached counter: confined to the worker thread
        wire, plain = self.wire, self.counter.private()
        batch = [items[i] for i in todo]
        counts = await asyncio.get_running_loop().run_in_executor(
            executor, lambda: [wire.item_tokens(m, plain) for m in batch])
        for i, n in zip(todo, counts):
            self._msg_tokens[i] = n

    def hist_chars(self) -> int:
        """The history's characters as the client sent it (no planning stage changes
        conv.chars): each item's content as jq's `tostring | length`, summed."""
        if self.conv is not None:
            return self.conv.total_chars
        return sum(self.wire.item_chars(m) for m in self.messages)

    def sent_chars(self) -> int:
        """hist_chars' measure of the forwarded history: the kept items (compacted ones
        at their compacted size) and the carry note."""
        assert self.plan is not None and self.conv is not None
        chars, compacted = self.conv.chars, self.compacted
        n = sum(self.compact_chars[i] if i in compacted else chars[i] for i in self.plan.kept)
        return n + (self.wire.item_chars(self.wire.note_item(self.note))
                    if self.note is not None else 0)

    def est_tokens(self) -> int:
        """The estimate for the whole request (counts cached per message content)."""
        return self.overhead_tokens() + self.all_message_tokens() if self.parsed_items() else 0

    def parsed_items(self) -> bool:
        """Is the history a non-empty list of objects (what counting needs)?"""
        msgs = self.messages
        if self.conv is not None:  # the parser checked every item
            return bool(msgs)
        return bool(msgs) and all(isinstance(m, dict) for m in msgs)

    def all_message_tokens(self) -> int:
        counts = self._msg_tokens
        if counts is None or min(counts, default=0) < 0:  # count what is missing first
            counts = self._inherit_counts()
            for i in [i for i, n in enumerate(counts) if n < 0]:
                self.message_tokens(i)
        return sum(counts)

    def _inherit_counts(self) -> list[int]:
        """This request's counts, with the unchanged items' gaps filled from the
        session's previous request: it may have counted them since this one started
        (concurrent requests of a session: each counts what its plan skipped)."""
        counts = self._msg_tokens
        if counts is None:
            counts = self._msg_tokens = [-1] * len(self.messages)
        view = self.view
        prev = view.prev if view is not None else None
        if (prev is not None and view is not None and 0 < view.known <= len(prev.tokens)
                and prev.token_key is self.counter):
            known, theirs = view.known, prev.tokens
            counts[:known] = [n if n >= 0 else m for n, m in zip(counts[:known], theirs)]
        return counts


def current_turn_start(conv: Conversation | None) -> int | None:
    """The first message of the current turn's groups (groups are in turn order; with
    the input begun in an earlier turn, from that turn on)."""
    if conv is None:
        return None
    start = None
    first = conv.first_current_turn
    for g in reversed(conv.groups):
        if g.turn < first:
            break
        start = g.indices[0] if start is None else min(start, g.indices[0])
    return start
