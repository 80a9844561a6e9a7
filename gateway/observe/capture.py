"""Sample capture: full request payloads before and after eviction, for replay.

Bounded in memory (a queue that drops, and counts, when full) and on disk
(oldest files deleted past `max_files`); written by a background task in a
worker thread, never on the request path. Headers are not stored at all, so
Authorization / x-api-key cannot end up in a capture; a credential a client puts in
the body's top level (LiteLLM-style `api_key`, ...) is written "[redacted]".
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.config.schema import CaptureRules
from gateway.wire.jsonbytes import apply, members, ws

# top-level body fields that carry a credential (compared lower-cased)
SECRET_FIELDS = frozenset((
    "api_key", "apikey", "api-key", "x-api-key", "x_api_key", "authorization",
    "access_token", "auth_token", "bearer_token", "client_secret", "secret_key", "password",
    "aws_secret_access_key", "aws_session_token", "aws_access_key_id"))
_SECRET_HINT = re.compile(
    rb'"(?:api[_-]?key|x[_-]api[_-]key|authorization|access_token|auth_token|bearer_token'
    rb'|client_secret|secret_key|password|aws_secret_access_key|aws_session_token'
    rb'|aws_access_key_id)"', re.IGNORECASE)
REDACTED = b'"[redacted]"'


def redacted(raw: bytes) -> bytes:
    """A JSON body with the values of its top-level credential fields (SECRET_FIELDS)
    written "[redacted]"; every other byte as it was."""
    if _SECRET_HINT.search(raw) is None:
        return raw
    try:
        top = members(raw, ws(raw, 0))
    except (IndexError, ValueError):
        return raw
    edits = [(m.value, m.end, REDACTED) for m in top if m.name.lower() in SECRET_FIELDS]
    return apply(raw, edits) if edits else raw


class Capture:
    def __init__(self, queue_size: int = 256) -> None:
        self.queue: asyncio.Queue[tuple[CaptureRules, str, bytes]] = asyncio.Queue(queue_size)
        self.after_change = 0
        self.dropped = 0
        self.written = 0

    def config_changed(self, rules: CaptureRules) -> None:
        """The next `around_change` requests are captured: before/after samples per change."""
        self.after_change = rules.around_change if rules.enabled else 0

    def offer(self, rules: CaptureRules, rid: str, make: Callable[[], dict[str, Any]]) -> bool:
        """Queue one record (`make()`, called only for a sampled request: making it reads
        both bodies) if this request is sampled; never blocks."""
        if not rules.enabled:
            return False
        if self.after_change > 0:
            self.after_change -= 1
        elif random.random() >= rules.sample_rate:
            return False
        try:
            self.queue.put_nowait((rules, rid, orjson.dumps(make())))
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    async def run(self) -> None:
        while True:
            rules, rid, data = await self.queue.get()
            try:
                await asyncio.to_thread(self._write, rules, rid, data)
            finally:
                self.queue.task_done()

    async def drain(self, timeout_s: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self.queue.join(), timeout_s)
        except TimeoutError:
            pass

    def _write(self, rules: CaptureRules, rid: str, data: bytes) -> None:
        d = Path(rules.dir)
        d.mkdir(parents=True, exist_ok=True)
        name = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{time.time_ns() % 10**9:09d}-{rid}"
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, d / f"{name}.json")
        self.written += 1
        files = sorted(p for p in d.glob("*.json"))
        for old in files[: max(0, len(files) - rules.max_files)]:
            old.unlink(missing_ok=True)


def record(mem: dict[str, Any], api: str, raw: bytes, parsed_ok: bool, forward: bytes) -> dict[
        str, Any]:
    """A capture: the [mem] fields and both bodies, embedded as JSON when they are JSON."""
    return {
        "mem": mem,
        "api": api,
        "before": (orjson.Fragment(redacted(raw)) if parsed_ok
                   else raw.decode("utf-8", "replace")),
        "after": (orjson.Fragment(redacted(forward)) if parsed_ok
                  else forward.decode("utf-8", "replace")),
    }


SIDES = ("before", "after")
_CAPTURE_KEYS = frozenset(("mem", "api", "before", "after"))
SIDE_MEANS = {"before": "what the client sent", "after": "what the gateway forwarded"}


def is_capture(rec: Any) -> bool:
    """A file this module wrote: {mem, api, before, after}, not a request body."""
    return (isinstance(rec, dict) and _CAPTURE_KEYS <= rec.keys()
            and "messages" not in rec and "input" not in rec)


def unwrap(raw: bytes, rec: dict[str, Any], side: str = "before") -> tuple[bytes, Any, str]:
    """(body bytes, parsed body, api) of one side of a capture.

    The bytes are the captured ones, cut out of the file rather than re-serialised
    (big integers, escapes and key order as the client sent them); a side that was
    not JSON when captured (stored as text) parses to None, as the gateway saw it."""
    from gateway.wire.jsonbytes import value_span, ws

    value = rec[side]
    api = str(rec.get("api") or "")
    if isinstance(value, str):
        body = value.encode("utf-8")
        try:
            return body, orjson.loads(body), api
        except orjson.JSONDecodeError:
            return body, None, api
    try:
        start, end = value_span(raw, ws(raw, 0), rec, [side])
        return raw[start:end], value, api
    except (ValueError, IndexError):  # not the bytes of `rec`: its serialisation
        return orjson.dumps(value), value, api


def describe_side(where: str, side: str, api: str) -> str:
    """The line a tool prints when it read a capture: which side of which file."""
    return f"{where}: a capture ({api or 'api unknown'}); using `{side}` ({SIDE_MEANS[side]})"


def wire_named(api: str) -> Any:
    """The Wire a capture's `api` names (a wire's `name`), or None."""
    from gateway.wire import WIRES

    return next((w for w in WIRES.values() if w.name == api), None)
