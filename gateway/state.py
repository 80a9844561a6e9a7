"""Per-session state of a running gateway: what was forwarded last time.

Keyed by (tenant, session): the tenant comes from the caller's credentials, so
a session id that two tenants share, or that a client forges, never reaches
another tenant's state. In-process and bounded (LRU) by default. Nothing here
is needed for correctness — the stepped cut is recomputed from the history
alone — it lets the [mem] line say whether the forwarded prefix stayed the same.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SessionRecord:
    kept: tuple[int, ...]  # message indices forwarded last time
    n_messages: int  # history length last time
    last: bytes  # fingerprint of the last message last time (append-only check)
    cut: bool  # whether anything was dropped last time
    msg_tokens: int  # tokens of all messages last time (est_tokens without overhead)
    before_last: bytes = b""  # fingerprint of the message before the last one
    msg_tokens_before_last: int = 0  # tokens of all messages but the last one


def fingerprint(message: Any) -> bytes:
    """A stable fingerprint of one message (same on every replica)."""
    return hashlib.blake2b(orjson.dumps(message), digest_size=8).digest()


class SessionStore(Generic[T]):
    """A bounded LRU of per-session values by (tenant, session)."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self._records: OrderedDict[tuple[str, str], T] = OrderedDict()

    def get(self, tenant: str, session: str) -> T | None:
        key = (tenant, session)
        rec = self._records.get(key)
        if rec is not None:
            self._records.move_to_end(key)
        return rec

    def put(self, tenant: str, session: str, rec: T) -> None:
        key = (tenant, session)
        self._records[key] = rec
        self._records.move_to_end(key)
        while len(self._records) > self.max_sessions:
            self._records.popitem(last=False)

    def __len__(self) -> int:
        return len(self._records)

    def find(self, session: str) -> dict[str, T]:
        """Every tenant's value for this session id (the admin view)."""
        return {t: v for (t, s), v in self._records.items() if s == session}


def appended(prev: SessionRecord | None, messages: Sequence[Any]) -> bool:
    """Is this history the previous one with messages appended (what clients send)?"""
    return (
        prev is not None
        and 0 < prev.n_messages <= len(messages)
        and fingerprint(messages[prev.n_messages - 1]) == prev.last
    )


def known_prefix(prev: SessionRecord | None, messages: Sequence[Any]) -> tuple[int, int]:
    """(n, tokens): the first n messages are known from the previous request, with their
    tokens — all of them when the client appended, all but the last when it replaced the
    last message (a retry or an edited question)."""
    if prev is None:
        return 0, 0
    if appended(prev, messages):
        return prev.n_messages, prev.msg_tokens
    n = prev.n_messages - 1
    if 0 < n <= len(messages) and prev.before_last and fingerprint(messages[n - 1]) == prev.before_last:
        return n, prev.msg_tokens_before_last
    return 0, 0


def compare_cut(
    prev: SessionRecord | None, grown: bool, kept: Sequence[int], cut: bool
) -> tuple[str, int]:
    """`cut=` value (none | kept | moved) and how many forwarded messages at the start
    are the same as in the previous forwarded request of this session."""
    same = 0
    if prev is not None and grown:
        # the history grew by appending: index i is the same message as last time
        n = min(len(prev.kept), len(kept))
        while same < n and prev.kept[same] == kept[same]:
            same += 1
    if not cut:
        return "none", same
    if prev is not None and prev.cut and same == len(prev.kept):
        return "kept", same
    return "moved", same
