"""One setting bounds the per-process caches keyed by content (`limits.cache_mb`).

Each worker holds its own: the history cache (its estimate of what its entries hold),
the token counts by text, the carry's per-message extraction and tool-call facts, the
fill's words per group and the compacted tool results. Each gets a fixed share of the
total, the shares summing to it; none is needed for correctness (a forgotten entry is
worked out again), so a smaller bound costs CPU, never a different answer. Applied at
start-up and on every reload.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config.schema import Rules
from gateway.policy import compact, fill
from gateway.policy.carry import calls, snapshot
from gateway.proxy.appstate import GatewayState


@dataclass(frozen=True, slots=True)
class CacheBounds:
    """Bytes each cache may hold."""

    history: int  # 5/8, at most session.history_cache_mb (0: the cache is off)
    tokens: int  # 1/8, the encodings' caches together
    extract: int  # 1/16 each below
    words: int
    facts: int
    compacted: int

    def total(self) -> int:
        return (self.history + self.tokens + self.extract + self.words + self.facts
                + self.compacted)


def cache_bounds(rules: Rules) -> CacheBounds:
    total = rules.cache_mb << 20
    part = total // 16
    return CacheBounds(history=min(rules.history_cache_mb << 20, total - 6 * part),
                       tokens=2 * part, extract=part, words=part, facts=part,
                       compacted=part)


def bound_caches(state: GatewayState, rules: Rules) -> CacheBounds:
    """Give every per-process content cache its share of `limits.cache_mb` (trimming
    those over it now)."""
    b = cache_bounds(rules)
    state.history.resize(b.history, rules.max_tracked_sessions)
    state.tokenizers.bound(b.tokens)
    for memo, limit in ((snapshot.EXTRACTED, b.extract), (fill.COUNTED, b.words),
                        (calls.FACTS, b.facts)):
        memo.bound(limit)
    compact.bound_memo(b.compacted)
    return b
