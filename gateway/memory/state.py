"""Per-session state of a running gateway: what was forwarded last time.

Keyed by (tenant, session): the tenant comes from the caller's credentials, so
a session id that two tenants share, or that a client forges, never reaches
another tenant's state. In-process and bounded (LRU) by default. Nothing here
is needed for correctness — the stepped cut is recomputed from the history
alone — it lets the [mem] line say whether the forwarded prefix stayed the same. It also
remembers which session each Responses answer belonged to, so that a request continuing
it (`previous_response_id`) stays in that session; an answer forgotten (LRU, ttl, Redis
down) leaves its continuation to the next source of `session.id_from`.
"""

from __future__ import annotations

import hashlib
import marshal
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson

from gateway.memory.backends import Backend

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SessionRecord:
    # the message indices forwarded last time, as runs (`runs`): a history of any length
    # forwarded whole is two numbers
    kept: tuple[int, ...]
    n_messages: int  # history length last time
    last: bytes  # fingerprint of the last message last time (append-only check)
    cut: bool  # whether anything was dropped last time
    msg_tokens: int  # tokens of all messages last time (est_tokens without overhead)
    before_last: bytes = b""  # fingerprint of the message before the last one
    msg_tokens_before_last: int = 0  # tokens of all messages but the last one


def _glob_escape(text: str) -> str:
    """`text` matched literally in a Redis SCAN pattern."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def runs(indices: Sequence[int]) -> tuple[int, ...]:
    """Indices as the start and stop of each run of consecutive ones (a step of one),
    flattened: (0, 3, 7, 9) is 0, 1, 2, 7, 8."""
    if isinstance(indices, range) and indices.step == 1:
        return (indices.start, indices.stop) if indices else ()
    out: list[int] = []
    for i in indices:
        if out and out[-1] == i:
            out[-1] = i + 1
        else:
            out += (i, i + 1)
    return tuple(out)


def runs_len(kept: tuple[int, ...]) -> int:
    return sum(kept[1::2]) - sum(kept[::2])


def fingerprint(message: Any) -> bytes:
    """A stable fingerprint of one message (same on every replica)."""
    try:
        data = orjson.dumps(message)
    except orjson.JSONEncodeError:  # nested deeper than orjson writes (255..1024 levels)
        data = marshal.dumps(message, 2)  # version 2: no refs, the same bytes everywhere
    return hashlib.blake2b(data, digest_size=8).digest()


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


class MemoryState:
    """Per-session state in this process (the embedded default)."""

    backend = "memory"

    def __init__(self, max_sessions: int) -> None:
        self.records: SessionStore[SessionRecord] = SessionStore(max_sessions)
        self.snapshots: SessionStore[dict[str, Any]] = SessionStore(max_sessions)
        # Responses answer id -> the session of the request it answered, by (tenant, id):
        # the latest answers, about one per live session (a chain continues its last one)
        self.responses: SessionStore[str] = SessionStore(max_sessions)

    async def get_record(self, tenant: str, session: str) -> SessionRecord | None:
        return self.records.get(tenant, session)

    async def put_record(self, tenant: str, session: str, rec: SessionRecord) -> None:
        self.records.put(tenant, session, rec)

    async def put_snapshot(self, tenant: str, session: str, fields: dict[str, Any]) -> None:
        self.snapshots.put(tenant, session, fields)

    async def get_response_session(self, tenant: str, response_id: str) -> str | None:
        return self.responses.get(tenant, response_id)

    async def put_response_session(self, tenant: str, response_id: str, session: str) -> None:
        self.responses.put(tenant, response_id, session)

    async def find_snapshots(self, session: str) -> dict[str, dict[str, Any]]:
        return self.snapshots.find(session)

    async def close(self) -> None:
        return None


MAX_CONNECTIONS = 64  # to Redis per process: a burst beyond it queues for one


class RedisState:
    """Per-session state in Redis, shared by every replica (keys expire after ttl_s).

    Every command is bounded by the connect and read timeouts, is not retried, and goes
    through `health`: a Redis that refuses or hangs raises BackendDown quickly, then is
    skipped for `retry_after_s`.
    """

    backend = "redis"

    def __init__(self, url: str, ttl_s: int, prefix: str, health: Backend,
                 connect_timeout_s: float, read_timeout_s: float) -> None:
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # redis-py's defaults (5 s socket timeout, 3 retries with backoff) held every
        # request ~5 s behind a hung Redis; the breaker is what retries here. Its default
        # pool raises past 100 connections, which marked a healthy Redis down under a
        # burst: a command waits for a connection instead (within its own bound)
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=None,
            socket_connect_timeout=connect_timeout_s, socket_timeout=read_timeout_s,
            retry=Retry(NoBackoff(), 0))
        self.client = redis.Redis.from_pool(pool)  # closed with the client
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.health = health
        # one command: a connect and one answer (the socket timeouts bound each read)
        self.timeout_s = connect_timeout_s + read_timeout_s

    def _key(self, kind: str, tenant: str, session: str) -> str:
        return f"{self.prefix}:{kind}:{tenant}:{session}"

    async def get_record(self, tenant: str, session: str) -> SessionRecord | None:
        """The record (`rec2`), else one a version before runs wrote (`rec`, with the
        indices themselves: read in the same round trip). Records are written as `rec2`
        only, so a replica of that version, during a rolling update, never reads a shape
        it does not know (it sees its own last record, or none)."""
        new, old = await self.health.call(
            "get_record", lambda: self.client.mget(self._key("rec2", tenant, session),
                                                   self._key("rec", tenant, session)),
            self.timeout_s)
        raw = new if new is not None else old
        if raw is None:
            return None
        d = orjson.loads(raw)
        kept = tuple(d["runs"]) if new is not None else runs(d["kept"])
        return SessionRecord(kept=kept, n_messages=d["n"],
                             last=bytes.fromhex(d["last"]), cut=d["cut"], msg_tokens=d["tok"],
                             before_last=bytes.fromhex(d["before_last"]),
                             msg_tokens_before_last=d["tok_before_last"])

    async def put_record(self, tenant: str, session: str, rec: SessionRecord) -> None:
        value = orjson.dumps({"runs": rec.kept, "n": rec.n_messages, "last": rec.last.hex(),
                              "cut": rec.cut, "tok": rec.msg_tokens,
                              "before_last": rec.before_last.hex(),
                              "tok_before_last": rec.msg_tokens_before_last})
        await self.health.call(
            "put_record",
            lambda: self.client.set(self._key("rec2", tenant, session), value, ex=self.ttl_s),
            self.timeout_s)

    async def put_snapshot(self, tenant: str, session: str, fields: dict[str, Any]) -> None:
        await self.health.call(
            "put_snapshot",
            lambda: self.client.set(self._key("snap", tenant, session), orjson.dumps(fields),
                                    ex=self.ttl_s),
            self.timeout_s)

    async def get_response_session(self, tenant: str, response_id: str) -> str | None:
        """The session whose request this answer id answered (previous_response_id)."""
        raw = await self.health.call(
            "get_response_session",
            lambda: self.client.get(self._key("resp", tenant, response_id)), self.timeout_s)
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw

    async def put_response_session(self, tenant: str, response_id: str, session: str) -> None:
        await self.health.call(
            "put_response_session",
            lambda: self.client.set(self._key("resp", tenant, response_id), session.encode(),
                                    ex=self.ttl_s),
            self.timeout_s)

    async def find_snapshots(self, session: str) -> dict[str, dict[str, Any]]:
        async def scan() -> dict[str, dict[str, Any]]:
            out: dict[str, dict[str, Any]] = {}
            head, tail = f"{self.prefix}:snap:", f":{session}"
            pattern = f"{_glob_escape(head)}*{_glob_escape(tail)}"
            async for key in self.client.scan_iter(match=pattern, count=500):
                raw = await self.client.get(key)
                name = key.decode()
                # by length: a prefix or a session id may hold ":" (a tenant never does)
                tenant = name[len(head):len(name) - len(tail)]
                if raw is not None and ":" not in tenant and name == head + tenant + tail:
                    out[tenant] = orjson.loads(raw)
            return out

        # an admin look-up scans: several round trips, each bounded by the read timeout
        return await self.health.call("find_snapshots", scan, None)

    async def ping(self) -> None:
        """Is Redis answering? (/readyz; BackendDown when not)."""
        await self.health.call("ping", self.client.ping, self.timeout_s)

    async def close(self) -> None:
        await self.client.aclose()


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
    if (0 < n <= len(messages) and prev.before_last
            and fingerprint(messages[n - 1]) == prev.before_last):
        return n, prev.msg_tokens_before_last
    return 0, 0


def compare_cut(
    prev: SessionRecord | None, known: int, kept: Sequence[int], cut: bool
) -> tuple[str, int]:
    """`cut=` value (none | kept | moved) and how many forwarded messages at the start
    are the same as in the previous forwarded request of this session (the record's
    indices are runs). `known`: how many of this request's first messages are the
    previous request's (known_prefix): all of them when the client appended, all but
    the last when it replaced the last one (a retry, an edited question, a regenerate),
    whose forwarded prefix is then compared up to the replaced message."""
    same = 0
    before: tuple[int, ...] = ()  # the previous request's forwarded runs compared
    if prev is not None and known:
        # index i < known is the same message as last time
        before = _below(prev.kept, known)
        same = _common_start(before, kept)
    if not cut:
        return "none", same
    if prev is not None and prev.cut and known and same == runs_len(before):
        return "kept", same
    return "moved", same


def _below(runs_: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The runs of the indices under n."""
    out: list[int] = []
    for start, stop in zip(runs_[::2], runs_[1::2]):
        if start >= n:
            break
        out += (start, min(stop, n))
    return tuple(out)


def _common_start(runs_: tuple[int, ...], kept: Sequence[int]) -> int:
    """How many of `kept` are, from the start, the indices of `runs_`."""
    same, n = 0, len(kept)
    for start, stop in zip(runs_[::2], runs_[1::2]):
        for i in range(start, stop):
            if same >= n or kept[same] != i:
                return same
            same += 1
    return same
