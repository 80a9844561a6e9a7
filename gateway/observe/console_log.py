"""The console's memory of recent requests: an observer of each [mem] line, in fixed bounds.

A bucket per minute for the last hour, and for at most `console.max_sessions` sessions
(the least recently seen forgotten first) a ring of their last `console.ring` requests:
sizes, roles, stages and ids; the text of the carry note and of recalled records only
with `console.show_text`; never a message's text, a header or a credential. The pages
that show it are console_view.py; their routes are gateway.proxy.console.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.config.schema import ConsoleRules

MINUTES = 60  # the last hour, a bucket a minute
SAMPLES = 512  # overhead samples per minute for the percentiles (a reservoir beyond)
STRIP_SEGMENTS = 240  # runs of one request's message strip; the rest merged into one
TEXT_CHARS = 2000  # of the note and of each recalled record (show_text only)
RECORDS_SHOWN = 5
SESSION_CHARS = 128  # session ids come from clients
TOP_SESSIONS = 20

# the [mem] fields a request's row shows (all small numbers, names and flags)
SHOWN = ("turn", "hist_msgs", "hist_chars", "est_tokens", "budget_tokens", "fixed_tokens",
         "evict", "would_evict", "kept", "dropped", "would_drop", "pinned", "pinned_overflow",
         "recalled", "recalled_tokens", "recalled_records", "recall", "compacted",
         "compacted_saved_tokens", "over_budget", "cut", "prefix_tokens", "carried", "mode",
         "status", "upstream_ms", "overhead_ms", "req", "api", "stream", "fallback",
         "first_status", "usage_in", "usage_cached", "usage_out", "usage_cache_write",
         "state", "reason", "archived", "media", "tokenizer", "retrieve", "retrieve_rounds",
         "retrieve_ms", "retrieve_in_tokens", "retrieve_out_tokens", "retrieve_error")
_SHOWN = frozenset(SHOWN)

Segment = tuple[int, int, str]  # first message, count, kind
# (tenant, session): the tenant id (`t-<16 hex>`, the configured anonymous name, or "" for
# a caller without a credential) keeps apart the sessions of two tenants that share an id
SessionKey = tuple[str, str]
# why the planner kept a message -> its kind on the strip (any other reason: kept)
_KEPT_AS = {k: k for k in ("system", "current", "pinned", "recalled")}


@dataclass(slots=True)
class Minute:
    """What one minute's requests added up to."""

    minute: int
    requests: int = 0
    client_tokens: int = 0  # est_tokens: the history as the client sent it
    forwarded_tokens: int = 0  # the history as forwarded (what the plan kept)
    usage_requests: int = 0  # answers that carried the provider's usage
    usage_in: int = 0
    usage_cached: int = 0
    usage_out: int = 0
    over_budget: int = 0
    fallback: int = 0
    errors: int = 0  # status >= 400 (499: the client left)
    dropped: dict[str, int] = field(default_factory=dict)  # stage -> messages (or would)
    overhead: list[float] = field(default_factory=list)
    offered: int = 0  # overhead samples seen (the reservoir keeps SAMPLES of them)


@dataclass(slots=True)
class Seen:
    """One request as a session's ring keeps it."""

    at: float
    fields: dict[str, Any]  # the SHOWN [mem] fields it had
    model: str | None
    forwarded_tokens: int
    strip: tuple[Segment, ...]
    note_chars: int | None
    note: str | None  # show_text only
    records: tuple[int, ...]  # characters of each recalled record
    record_texts: tuple[str, ...]  # show_text only


@dataclass(slots=True)
class SessionLog:
    ring: deque[Seen]
    requests: int = 0


def message_strip(d: Any) -> tuple[tuple[Segment, ...], dict[str, int]]:
    """The decision's messages as runs of one kind (system, current, pinned, recalled,
    compacted, kept, drop:<stage>), and the messages each stage dropped (or would drop,
    in shadow). Walks the kept messages and the dropped runs, never each dropped message."""
    n = len(d.messages) if d is not None and d.conv is not None else 0
    p = d.plan if n else None
    if p is None or (not p.dropped and p.kept_by[:1] == ("fits",)):
        return ((0, n, "kept"),) if n else (), {}
    kept: list[Segment] = []
    compacted = d.compacted
    start, last, run = -2, -2, ""
    for i, by in zip(p.kept, p.kept_by):
        kind = "compacted" if compacted and i in compacted else _KEPT_AS.get(by, "kept")
        if i == last + 1 and kind == run:
            last = i
            continue
        if run:
            kept.append((start, last - start + 1, run))
        start, last, run = i, i, kind
    if run:
        kept.append((start, last - start + 1, run))
    dropped: dict[str, int] = {}
    out: list[Segment] = []
    k = 0
    for lo, hi, stage in p.dropped.spans():
        while k < len(kept) and kept[k][0] < lo:
            out.append(kept[k])
            k += 1
        at = lo
        while k < len(kept) and kept[k][0] <= hi:  # fixed messages inside the run
            if kept[k][0] > at:
                out.append((at, kept[k][0] - at, f"drop:{stage}"))
                dropped[stage] = dropped.get(stage, 0) + kept[k][0] - at
            out.append(kept[k])
            at = kept[k][0] + kept[k][1]
            k += 1
        if hi + 1 > at:
            out.append((at, hi + 1 - at, f"drop:{stage}"))
            dropped[stage] = dropped.get(stage, 0) + hi + 1 - at
    out.extend(kept[k:])
    if len(out) > STRIP_SEGMENTS:
        first = out[STRIP_SEGMENTS - 1][0]
        out[STRIP_SEGMENTS - 1:] = [(first, n - first, "more")]
    return tuple(out), dropped


def forwarded_tokens(fields: dict[str, Any], d: Any) -> int:
    """The history's tokens as forwarded (the carry note not included), as the
    memgate_history_tokens_after metric counts them."""
    est = int(fields.get("est_tokens") or 0)
    p = d.plan if d is not None else None
    if p is not None and d.conv is not None and d.mode == "on" and (p.dropped or d.compacted):
        return int(d.kept_tokens())
    return est


class Console:
    """The console's bounded memory of recent requests; `observe` is the observer."""

    def __init__(self, rules: ConsoleRules, clock: Callable[[], float] = time.time) -> None:
        self.rules = rules
        self.clock = clock
        self.minutes: list[Minute | None] = [None] * MINUTES
        self.sessions: OrderedDict[SessionKey, SessionLog] = OrderedDict()
        self._rnd = random.Random(0)  # the reservoir's draws: reproducible

    def configure(self, rules: ConsoleRules) -> None:
        """A reload: keep what fits the new bounds."""
        if rules.ring != self.rules.ring:
            for log in self.sessions.values():
                log.ring = deque(log.ring, maxlen=rules.ring)
        if self.rules.show_text and not rules.show_text:  # what was kept is let go too
            for log in self.sessions.values():
                log.ring = deque((_without_text(s) for s in log.ring), maxlen=rules.ring)
        while len(self.sessions) > rules.max_sessions:
            self.sessions.popitem(last=False)
        self.rules = rules

    def _minute(self, now: float) -> Minute:
        m = int(now // 60)
        slot = self.minutes[m % MINUTES]
        if slot is None or slot.minute != m:
            slot = self.minutes[m % MINUTES] = Minute(m)
        return slot

    def observe(self, fields: dict[str, Any], d: Any, info: Any) -> None:
        """One request, after its [mem] line: counted into its minute and its session."""
        now = self.clock()
        b = self._minute(now)
        strip, dropped = message_strip(d)
        fwd = forwarded_tokens(fields, d)
        b.requests += 1
        b.client_tokens += int(fields.get("est_tokens") or 0)
        b.forwarded_tokens += fwd
        if "usage_in" in fields:
            b.usage_requests += 1
            b.usage_in += int(fields["usage_in"] or 0)
            b.usage_cached += int(fields.get("usage_cached") or 0)
            b.usage_out += int(fields.get("usage_out") or 0)
        b.over_budget += bool(fields.get("over_budget"))
        b.fallback += "fallback" in fields
        b.errors += int(fields.get("status") or 0) >= 400
        for stage, count in dropped.items():
            b.dropped[stage] = b.dropped.get(stage, 0) + count
        self._sample(b, float(fields.get("overhead_ms") or 0.0))
        session = str(fields.get("session") or "")[:SESSION_CHARS]
        if session:
            tenant = str(getattr(info, "tenant", None) or "")[:SESSION_CHARS]
            self._remember((tenant, session), self._seen(now, fields, d, fwd, strip))

    def _sample(self, b: Minute, value: float) -> None:
        b.offered += 1
        if len(b.overhead) < SAMPLES:
            b.overhead.append(value)
        else:
            k = self._rnd.randrange(b.offered)
            if k < SAMPLES:
                b.overhead[k] = value

    def _seen(self, now: float, fields: dict[str, Any], d: Any, fwd: int,
              strip: tuple[Segment, ...]) -> Seen:
        text = self.rules.show_text
        note = d.note if d is not None else None
        records = tuple(d.recalled[:RECORDS_SHOWN]) if d is not None else ()
        model = fields.get("model")
        return Seen(
            at=now, fields={k: v for k, v in fields.items() if k in _SHOWN},
            model=str(model)[:80] if model is not None else None, forwarded_tokens=fwd,
            strip=strip, note_chars=len(note) if note is not None else None,
            note=note[:TEXT_CHARS] if text and note is not None else None,
            records=tuple(len(r) for r in records),
            record_texts=tuple(r[:TEXT_CHARS] for r in records) if text else (),
        )

    def _remember(self, key: SessionKey, seen: Seen) -> None:
        log = self.sessions.get(key)
        if log is None:
            log = self.sessions[key] = SessionLog(deque(maxlen=self.rules.ring))
            while len(self.sessions) > self.rules.max_sessions:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(key)
        log.ring.append(seen)
        log.requests += 1

    def hour(self) -> list[Minute]:
        """The last 60 minutes, oldest first; a minute without requests is empty."""
        m = int(self.clock() // 60)
        out = []
        for k in range(m - MINUTES + 1, m + 1):
            slot = self.minutes[k % MINUTES]
            out.append(slot if slot is not None and slot.minute == k else Minute(k))
        return out

    def largest(self, n: int = TOP_SESSIONS) -> list[tuple[SessionKey, SessionLog]]:
        """The sessions whose latest request had the largest history."""
        def size(item: tuple[SessionKey, SessionLog]) -> tuple[int, float]:
            last = item[1].ring[-1]
            return int(last.fields.get("est_tokens") or 0), last.at
        return sorted(self.sessions.items(), key=size, reverse=True)[:n]


def _without_text(s: Seen) -> Seen:
    return Seen(s.at, s.fields, s.model, s.forwarded_tokens, s.strip, s.note_chars, None,
                s.records, ())
