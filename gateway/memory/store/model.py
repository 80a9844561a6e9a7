"""Memory records, filters and their exact semantics, shared by every backend.

Records come in three kinds (granularities): `session`, `turn`, `message`.
Timestamps must be timezone-aware ISO 8601 and are stored in UTC (microseconds
since the epoch, so boundaries compare exactly), between the years 1 and 9999 in
UTC so that every stored one can be written out again. Chinese (and other CJK)
text is indexed as overlapping character bigrams, so a full-text index built for
space-separated words finds "预算" inside "预算10万". No string holds a NUL
(PostgreSQL text cannot): in an id or a tag it is refused, in a text it is
stored as U+FFFD (a chat turn archived with one must not fail the request);
ids and tags are short enough for any backend's index, and a query uses at most
MAX_QUERY_TERMS distinct terms, so no input makes a store's work unbounded.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.config.schema import Boundary, StoreRules
from gateway.config.validate import MAX_ID_CHARS, check_tags
from gateway.measure.terms import index_text, query_terms

KINDS = ("session", "turn", "message")
ROLES = ("user", "assistant", "system", "tool")
# the fields a write may give, by kind (`kind` is an alias of memory_type); any other is
# refused by name: a field dropped silently would be a record not read back as written
_COMMON_FIELDS = ("memory_type", "kind", "memory_id", "session_id", "agent_id", "tags")
RECORD_FIELDS = {
    "turn": (*_COMMON_FIELDS, "ts", "turn_id", "user_text", "assistant_text", "role", "text"),
    "message": (*_COMMON_FIELDS, "ts", "text", "role", "message_id", "turn_id"),
    "session": (*_COMMON_FIELDS, "start_ts", "end_ts", "summary", "raw_messages_ref"),
}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)  # `// _US` is exact; `/ _US`, a float, rounds after ~2255
TS_MIN = (datetime(1, 1, 1, tzinfo=UTC) - _EPOCH) // _US
TS_MAX = (datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC) - _EPOCH) // _US


class StoreError(ValueError):
    """A request the store refuses: status and a precise message for the client."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


class StoreUnavailable(StoreError):
    """The backend cannot serve (unreachable, read-only, failing): 503 with the cause."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503)


class MemoryExists(StoreError):
    """A write of a memory_id the tenant holds already (records[index] of the write)."""

    def __init__(self, memory_id: str, index: int) -> None:
        super().__init__(f"memory_id {memory_id!r} exists already for this API key; delete it "
                         "first, or write without memory_id to get a new one", 409)
        self.memory_id, self.index = memory_id, index


def shown(v: Any) -> str:
    """A client's value for an error message: short, and never the repr of a deep tree."""
    if isinstance(v, str | int | float | bool) or v is None:
        text = repr(v)
        return text if len(text) <= 80 else text[:77] + "..."
    return f"a JSON {'array' if isinstance(v, list) else 'object'}"


def parse_ts(value: Any, key: str) -> int:
    """ISO 8601 with a timezone -> microseconds since the epoch (UTC)."""
    if not isinstance(value, str):
        raise StoreError(f"{key}: must be an ISO 8601 timestamp string")
    try:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise StoreError(f"{key}: not an ISO 8601 timestamp: {shown(value)}") from None
    if dt.tzinfo is None:
        raise StoreError(f"{key}: timestamp without a timezone: {shown(value)} "
                         "(add Z or an offset such as +08:00)")
    us = (dt - _EPOCH) // _US
    if not TS_MIN <= us <= TS_MAX:  # e.g. year 1 at +08:00 is year 0 in UTC
        raise StoreError(f"{key}: {shown(value)} is outside the years 1 to 9999 in UTC")
    return us


def format_ts(us: int) -> str:
    return (_EPOCH + timedelta(microseconds=us)).isoformat()


def now_us() -> int:
    return (datetime.now(UTC) - _EPOCH) // _US


def window(top_k: int) -> int:
    """How many of a query's best hits by the backend's own rank are scored (ranked) for
    its top_k: the backend's rank picks candidates, never their order."""
    return max(8 * top_k, 32)


def ranked(hits: list[tuple[Record, float]], query: str, top_k: int
           ) -> list[tuple[Record, float]]:
    """A backend's hits (its best `window(top_k)` by its own rank) scored by the share of
    the query's distinct terms each record contains, 0..1, best first, ties to the newer;
    the first top_k. Unlike FTS5's BM25, whose IDF is clamped to 1e-6 for a term in half
    the records or more (a store of one record scores its hit 1e-6), this score says the
    same on every backend and every store size, and the order is the tenant's own: FTS5's
    statistics are every tenant's (ordered by them, one tenant's hits would tell whether
    a word is in another's records). No query: every hit scores 0."""
    terms = query_terms(query)
    if not terms:
        return [(r, 0.0) for r, _ in hits][:top_k]
    scored = []
    for r, _ in hits:
        words = set(index_text(r.text).split())
        share = round(sum(t in words for t in terms) / len(terms), 4)
        if share:  # none of its words: a backend's own folding found it (SQLite's
            scored.append((r, share))  # FTS5 takes "cafe" for "café", PostgreSQL not)
    scored.sort(key=lambda h: (-h[1], -h[0].ts, h[0].memory_id))
    return scored[:top_k]


@dataclass(slots=True)
class Record:
    memory_id: str
    tenant: str
    agent_id: str
    memory_type: str
    session_id: str
    ts: int
    text: str
    tags: list[str]
    fields: dict[str, Any]
    ts_end: int | None = None
    truncated: bool = False
    original_chars: int | None = None

    def public(self, score: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "memory_id": self.memory_id, "memory_type": self.memory_type,
            "agent_id": self.agent_id, "session_id": self.session_id,
            "ts": format_ts(self.ts), "tags": self.tags, "text": self.text,
            **self.fields,
        }
        if self.ts_end is not None:
            out["end_ts"] = format_ts(self.ts_end)
        if self.truncated:
            out.update(truncated=True, original_chars=self.original_chars)
        if score is not None:
            out["score"] = round(score, 6)
        return out


def _text(body: dict[str, Any], key: str, required: bool = True, empty: bool = False) -> str:
    """A string field (non-empty unless `empty`; "" when absent and not required)."""
    v = body.get(key)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or not (v or empty):
        raise StoreError(f"{key}: required, a non-empty string")
    return v.replace("\0", "\ufffd")


def check_id(v: Any, key: str, integers: bool = False,
             limit: int | None = MAX_ID_CHARS) -> str:
    """An id as stored: a string without NUL (or, where `integers`, an integer), at most
    `limit` characters (None: an id no index is built on)."""
    if integers and isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if (not isinstance(v, str) or not v or (limit is not None and len(v) > limit)
            or "\0" in v):
        kinds = "a string or an integer" if integers else "a non-empty string"
        most = f" of at most {limit} characters" if limit is not None else ""
        raise StoreError(f"{key}: must be {kinds}{most}, without NUL, got {shown(v)}")
    return v


def _opt_id(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    return "" if v is None or v == "" else check_id(v, key, integers=True)


def _role(body: dict[str, Any]) -> str:
    role = body.get("role", "user")
    if not isinstance(role, str) or role not in ROLES:
        raise StoreError(f"role: must be user, assistant, system or tool, got {shown(role)}")
    return role


def _known_fields(body: dict[str, Any], kind: str, rules: StoreRules) -> None:
    """Refuse a field a `kind` record does not have, naming it and the accepted ones (and
    the kind it belongs to, when it is another kind's)."""
    accepted = RECORD_FIELDS[kind]
    unknown = [k for k in body if k not in accepted]
    if not unknown:
        return
    names = ", ".join(shown(k) for k in unknown[:5]) + (
        f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
    why = f"unknown field{'s' if len(unknown) > 1 else ''} {names} in a {kind} record"
    if "memory_type" not in body and "kind" not in body:
        why += f" (no memory_type: store.write_granularity's {rules.write_granularity})"
    other = [k for k in KINDS if k != kind and unknown[0] in RECORD_FIELDS[k]]
    if other:
        why += f"; {shown(unknown[0])} is a field of {' and '.join(other)} records"
    raise StoreError(f"{why}; accepted: {', '.join(accepted)}",
                     param=unknown[0][:MAX_ID_CHARS])


def build_record(body: Any, tenant: str, rules: StoreRules) -> Record:
    """Validate a write request into a Record (the tenant never comes from the body).

    A turn is written as its two sides (`user_text`, `assistant_text`) or, as seed 003's
    minimal write does, as one message (`role` + `text`); it is read back as written."""
    if not isinstance(body, dict):
        raise StoreError("body must be a JSON object")
    kind = body.get("memory_type") or body.get("kind") or rules.write_granularity
    if not isinstance(kind, str) or kind not in KINDS:
        raise StoreError(f"memory_type: must be one of {', '.join(KINDS)}, got {shown(kind)}")
    _known_fields(body, kind, rules)
    try:
        tags = check_tags(body.get("tags") or []) + list(rules.default_tags)
    except ValueError as exc:
        raise StoreError(f"tags: {exc}") from None
    agent = ("" if body.get("agent_id") in (None, "")  # no index on it: X-Agent-Id as sent
             else check_id(body["agent_id"], "agent_id", limit=None))
    session = check_id(body.get("session_id"), "session_id")
    fields: dict[str, Any] = {}
    ts_end = None
    if kind == "session":
        ts = parse_ts(body.get("start_ts"), "start_ts")
        ts_end = parse_ts(body.get("end_ts"), "end_ts")
        if ts_end < ts:
            raise StoreError("end_ts: earlier than start_ts")
        text = _text(body, "summary")
        fields["summary"] = text
        if body.get("raw_messages_ref") is not None:
            fields["raw_messages_ref"] = check_id(body["raw_messages_ref"], "raw_messages_ref",
                                                  integers=True)
    elif kind == "turn":
        ts = parse_ts(body.get("ts"), "ts")
        fields["turn_id"] = _opt_id(body, "turn_id")
        sides = body.get("user_text") is not None or body.get("assistant_text") is not None
        if sides and body.get("text") is not None:
            raise StoreError("a turn is written as user_text/assistant_text or as one message "
                             "(role + text), not both")
        if sides:
            user = _text(body, "user_text", required=False, empty=True)
            assistant = _text(body, "assistant_text", required=False, empty=True)
            if not (user or assistant):
                raise StoreError("a turn needs user_text and/or assistant_text (strings)")
            fields.update(user_text=user, assistant_text=assistant)
            text = f"{user}\n{assistant}".strip()
        elif body.get("text") is not None:
            text = _text(body, "text")
            fields["role"] = _role(body)
        else:
            raise StoreError("a turn needs user_text and/or assistant_text, or one message "
                             "as role + text")
    else:
        ts = parse_ts(body.get("ts"), "ts")
        text = _text(body, "text")
        fields.update(message_id=_opt_id(body, "message_id"), turn_id=_opt_id(body, "turn_id"),
                      role=_role(body))
    memory_id = body.get("memory_id")
    rec = Record(memory_id=uuid.uuid4().hex if memory_id is None or memory_id == ""
                 else check_id(memory_id, "memory_id"),
                 tenant=tenant, agent_id=agent, memory_type=kind, session_id=session, ts=ts,
                 text=text, tags=list(dict.fromkeys(tags)), fields=fields, ts_end=ts_end)
    limit = rules.max_chars_per_record
    if len(text) > limit:
        if rules.on_overlong == "reject":
            raise StoreError(f"record text is {len(text)} characters; the limit is {limit} "
                             "(store.max_chars_per_record, on_overlong: reject)", status=413)
        rec.original_chars, rec.truncated, rec.text = len(text), True, text[:limit]
        if "user_text" in rec.fields:  # a turn's two sides: cut as its text is, together
            user = rec.fields["user_text"][:limit]
            assistant = rec.fields["assistant_text"][: max(0, limit - len(user) - 1)]
            rec.fields.update(user_text=user, assistant_text=assistant)
            rec.text = f"{user}\n{assistant}".strip()
        if "summary" in rec.fields:
            rec.fields["summary"] = rec.fields["summary"][:limit]
    return rec


@dataclass(slots=True)
class Filter:
    """A validated search: every condition the results must satisfy."""

    tenant: str
    agent_id: str | None
    session_id: str | None  # None = cross-session (asked for explicitly)
    time_from: int
    time_to: int
    boundary: Boundary
    tags: list[str] = field(default_factory=list)
    memory_type: str | None = None
    query: str = ""
    top_k: int = 5

    def matches(self, r: Record) -> bool:
        """The filter's semantics, exactly (backends must agree with this)."""
        in_time = self.time_from <= r.ts and (
            r.ts <= self.time_to if self.boundary == "closed" else r.ts < self.time_to)
        return (
            r.tenant == self.tenant
            and (self.agent_id is None or r.agent_id == self.agent_id)
            and (self.session_id is None or r.session_id == self.session_id)
            and in_time
            and (not self.tags or bool(set(self.tags) & set(r.tags)))
            and (self.memory_type is None or r.memory_type == self.memory_type)
        )


def build_filter(body: Any, tenant: str, rules: StoreRules, now: int | None = None) -> Filter:
    if not isinstance(body, dict):
        raise StoreError("body must be a JSON object")
    f = body.get("filter") or {}
    if not isinstance(f, dict):
        raise StoreError("filter: must be an object")
    scope = body.get("scope", rules.session_scope)
    if not isinstance(scope, str) or scope not in ("current", "cross_session"):
        raise StoreError("scope: must be current or cross_session")
    session = f.get("session_id")
    if session is None and scope != "cross_session":
        raise StoreError("filter.session_id is required; cross-session search must be asked "
                         'for explicitly with "scope": "cross_session"')
    if session is not None:
        session = check_id(session, "filter.session_id")
    now = now_us() if now is None else now
    has_from, has_to = f.get("time_from") is not None, f.get("time_to") is not None
    if not has_from and not has_to:
        t_from, t_to = now - rules.default_time_window_s * 1_000_000, now
        boundary: Boundary = "closed"  # the default window includes "now"
    else:
        t_from = parse_ts(f["time_from"], "filter.time_from") if has_from else -(1 << 62)
        t_to = parse_ts(f["time_to"], "filter.time_to") if has_to else 1 << 62
        boundary = rules.time_boundary
        if t_to < t_from:
            raise StoreError("filter.time_to is earlier than filter.time_from")
    try:  # no tags named: the configured default_tags (an explicit [] filters none)
        tags = list(rules.default_tags) if "tags" not in f else check_tags(f["tags"] or [])
    except ValueError as exc:
        raise StoreError(f"filter.tags: {exc}") from None
    mtype = f.get("memory_type")
    if mtype is not None and (not isinstance(mtype, str) or mtype not in KINDS):
        raise StoreError(f"filter.memory_type: must be one of {', '.join(KINDS)}")
    top_k = body.get("top_k", rules.search_top_k)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 100:
        raise StoreError("top_k: must be an integer between 1 and 100")
    query = body.get("query") or ""
    if not isinstance(query, str):
        raise StoreError("query: must be a string")
    agent = f.get("agent_id")
    if agent is not None:
        agent = check_id(agent, "filter.agent_id", limit=None)
    return Filter(tenant=tenant, agent_id=agent, session_id=session, time_from=t_from,
                  time_to=t_to, boundary=boundary, tags=tags, memory_type=mtype, query=query,
                  top_k=top_k)
