"""Archive turns that leave the window, and recall them for the latest question.

Turns are written as `turn` records with a deterministic memory_id (tenant,
session, the turn's first message), so a stateless client that resends the
same history every request never archives a turn twice. Recall ranks, by the
same term overlap, the store's records and the turns this very request is
dropping (a client's first long request has nothing archived yet).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.config.schema import StoreRules
from gateway.decide.decision import Decision, current_turn_start
from gateway.measure.terms import index_text, query_terms
from gateway.memory.backends import Backend, BackendDown
from gateway.memory.state import fingerprint
from gateway.memory.store import Store
from gateway.memory.store.model import Filter, Record, build_record, format_ts, now_us
from gateway.policy.fill import STOPWORDS

MAX_RECALLED_CHARS = 1000
# the request waits for recall before it is forwarded: a slow store (a locked SQLite file
# waits 2 s for its lock) costs it this much once, then the breaker skips the store
RECALL_TIMEOUT_S = 0.5
OPEN_TIMEOUT_S = 0.5  # on the request path too: a store that cannot open is skipped


class Searcher(Protocol):
    async def search(self, f: Filter) -> list[tuple[Record, float]]: ...


class GuardedStore:
    """The store as a chat request searches it: opened and searched through its breaker,
    within the time bounds above, plus the records `pending(f)` gives (archived by this
    process, still in the write-behind queue: the next request of a session may come
    before the writer has written them). A failure is remembered (`failed`, for the [mem]
    line) and answers no stored records: recall falls back to the turns this request
    drops and the pending ones."""

    def __init__(self, open_store: Callable[[], Awaitable[Store]], health: Backend,
                 pending: Callable[[Filter], list[Record]] | None = None) -> None:
        self.open_store = open_store
        self.health = health
        self.pending = pending
        self.failed = False

    async def search(self, f: Filter) -> list[tuple[Record, float]]:
        queued = self.pending(f) if self.pending is not None else []
        try:
            store = await self.health.call("open", self.open_store, OPEN_TIMEOUT_S)
            found = await self.health.call("search", functools.partial(store.search, f),
                                           RECALL_TIMEOUT_S)
        except BackendDown:
            self.failed = True
            found = []
        ids = {r.memory_id for r, _ in found}
        # scored by `rank` with the rest: the score here is not read
        return found + [(r, 0.0) for r in queued if r.memory_id not in ids]


    async def get(self, tenant: str, memory_id: str,
                  queued: Callable[[], list[Record]] | None = None) -> Record | None:
        """One record of the tenant by id (a queued one first: `queued` gives them),
        None when there is none or the store failed."""
        for r in queued() if queued is not None else ():
            if r.tenant == tenant and r.memory_id == memory_id:
                return r
        try:
            store = await self.health.call("open", self.open_store, OPEN_TIMEOUT_S)
            return await self.health.call(
                "get", functools.partial(store.get, tenant, memory_id), RECALL_TIMEOUT_S)
        except BackendDown:
            self.failed = True
            return None


@dataclass(frozen=True, slots=True)
class TurnText:
    turn: int
    first: int  # index of its first message
    user: str
    assistant: str
    dropped: bool  # not forwarded by this request
    # left the window: dropped, or cut by the stages and brought back by the budget fill
    # for this question only (the next question, or a client that trims its history,
    # loses it: `evicted` archives it now)
    evicted: bool

    @property
    def text(self) -> str:
        return f"{self.user}\n{self.assistant}".strip()


def turns_of(d: Decision, since: int = 0) -> list[TurnText]:
    """The complete turns before the current one that start at message `since` or
    later, with their text and fate (groups before that are not looked at). Turn 0 (no
    user message of its own) is one when the client's opening context precedes it:
    Claude Code's first task, whose prompt is in its fixed opening message."""
    conv = d.conv
    if conv is None:
        return []
    groups = conv.groups
    opening = [i for i in conv.fixed if groups and i < groups[0].indices[0]
               and d.wire.item_role(d.messages[i]) == "user"]
    first = 0 if opening else 1  # the first turn that is a turn of its own
    g0 = bisect.bisect_left(groups, since, key=lambda grp: grp.indices[0])
    started_before = groups[g0 - 1].turn if 0 < g0 < len(groups) else None
    dropped = d.plan.dropped if d.plan is not None else None
    filled = frozenset(d.plan.recalled) if d.plan is not None else frozenset()
    by_turn: dict[int, list[int]] = {}
    gone: dict[int, bool] = {}
    cut: dict[int, bool] = {}
    for g in range(g0, len(groups)):
        grp = groups[g]
        if not first <= grp.turn < conv.first_current_turn or grp.turn == started_before:
            continue
        by_turn.setdefault(grp.turn, []).extend(grp.indices)
        out_g = dropped is not None and dropped.covers(g)
        gone[grp.turn] = gone.get(grp.turn, True) and out_g
        cut[grp.turn] = cut.get(grp.turn, True) and (out_g or grp.indices[0] in filled)
    out = []
    for turn, idx in by_turn.items():  # turns in order: groups are
        items = [d.messages[i] for i in idx]
        roles = [d.wire.item_role(m) for m in items]
        user = "\n".join(d.wire.item_text(m) for m, r in zip(items, roles, strict=True)
                         if r == "user") if turn else "\n".join(
            d.wire.item_text(d.messages[i]) for i in opening)
        assistant = "\n".join(d.wire.item_text(m) for m, r in zip(items, roles, strict=True)
                              if r == "assistant")
        out.append(TurnText(turn, idx[0], user, assistant, gone[turn], cut[turn]))
    return out


def archive_records(
    d: Decision, tenant: str, session: str, agent: str, rules: StoreRules, since: int = 0
) -> tuple[list[Record], int]:
    """Records for the complete turns from message `since` on that `rules.archive` asks
    for, and where the next request of the session may start: every complete turn
    before that point is in these records or was in the session's earlier ones."""
    which = rules.archive
    out = []
    now = now_us()
    upto: int | None = None  # the first turn left for later (kept, under `evicted`)
    for t in turns_of(d, since):
        if which == "evicted" and not t.evicted:
            if upto is None:
                upto = t.first
            continue
        if not t.text:
            continue
        mid = hashlib.sha256(
            tenant.encode() + b"\0" + session.encode() + b"\0" + fingerprint(d.messages[t.first])
        ).hexdigest()[:32]
        out.append(build_record(
            {"memory_id": mid, "memory_type": "turn", "agent_id": agent, "session_id": session,
             "turn_id": str(t.turn), "ts": format_ts(now), "user_text": t.user,
             "assistant_text": t.assistant, "tags": ["archived"]},
            tenant, rules))
    if upto is None:  # every complete turn is done: the next one to look at is the current
        cur = current_turn_start(d.conv)
        upto = max(since, cur if cur is not None else len(d.messages))
    return out, upto


@functools.lru_cache(maxsize=2048)
def _words(text: str) -> frozenset[str]:
    """A candidate's indexed words: a session's dropped turns are ranked again on every
    request, and indexing is most of the ranking (bounded: 2,048 texts, a few KB each)."""
    return frozenset(index_text(text).split())


def _score(terms: set[str], text: str) -> float:
    words = _words(text)
    hits = len(terms & words)
    return hits / math.sqrt(len(words) + 1) if hits else 0.0


def rank(query: str, candidates: list[str], top_k: int) -> list[str]:
    # the fill's rule: a question's function words ("what is the") match every record,
    # so only its other words count, unless it has none
    terms = set(query_terms(query))
    terms = (terms - STOPWORDS) or terms
    scored = sorted(
        ((s, -i, c) for i, c in enumerate(dict.fromkeys(candidates)) if (s := _score(terms, c))),
        reverse=True,
    )
    return [c[:MAX_RECALLED_CHARS] for _, _, c in scored[:top_k]]


def latest_question(d: Decision) -> str:
    for m in reversed(d.messages):
        if d.wire.item_role(m) == "user":
            return d.wire.item_text(m)
    return ""


async def recall(
    store: Searcher | None, rules: StoreRules, tenant: str, session: str, d: Decision
) -> list[str]:
    """Texts to bring back for the latest question: archived and being-dropped turns."""
    query = latest_question(d)
    if not query:
        return []
    candidates = [t.text for t in turns_of(d) if t.dropped]
    if store is not None:
        f = Filter(tenant=tenant, agent_id=None,
                   session_id=session if rules.recall_scope == "current" else None,
                   time_from=now_us() - rules.default_time_window_s * 1_000_000,
                   time_to=now_us(), boundary="closed", query=query,
                   top_k=rules.recall_top_k * 3)
        kept = {t.text for t in turns_of(d) if not t.dropped}
        candidates += [r.text for r, _ in await store.search(f) if r.text not in kept]
    return rank(query, candidates, rules.recall_top_k)
