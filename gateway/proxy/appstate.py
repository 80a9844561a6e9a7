"""GatewayState and its AppKey: what a running gateway changes, in a module of its own.

app.py builds it and the request handlers read it; keeping it apart from both means neither
imports the other (handlers used to import app for it while app imported handlers for the
routes, a cycle)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway.config.reload import Reloader
from gateway.config.schema import Rules
from gateway.decide.history import HistoryCache
from gateway.measure.tokens import Tokenizers
from gateway.memory.api import MemoryService
from gateway.memory.backends import Backend
from gateway.memory.state import MemoryState, RedisState
from gateway.observe.capture import Capture
from gateway.observe.metrics import Metrics
from gateway.proxy.upstream import UpstreamPool

if TYPE_CHECKING:
    from gateway.observe.console_log import Console


class RefusedSessions:
    """Sessions whose changed body an upstream refused lately: their requests go as the
    client sent them until the backoff has passed (then eviction is tried again), so a
    session pays the refused round trip once per backoff, not on every request. Per
    process, at most `max_entries` (the least recently refused go first)."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    def mark(self, key: tuple[str, str], backoff_s: float) -> None:
        if backoff_s <= 0:
            return
        self._until[key] = time.monotonic() + backoff_s
        self._until.move_to_end(key)
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def holds(self, key: tuple[str, str]) -> bool:
        until = self._until.get(key)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._until[key]
        return False

    def __len__(self) -> int:
        return len(self._until)


@dataclass
class GatewayState:
    """Everything a running gateway changes at runtime, behind one AppKey."""

    reloader: Reloader
    tokenizers: Tokenizers
    sessions: MemoryState | RedisState
    # the store as recall reads it and as the archive writer writes it: a full disk fails
    # the writes only, so it does not switch recall off
    store_health: Backend
    archive_health: Backend
    history: HistoryCache = field(default_factory=lambda: HistoryCache(0, 0))
    metrics: Metrics = field(default_factory=Metrics)
    capture: Capture = field(default_factory=Capture)
    memory: MemoryService | None = None
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # one thread counts the tokens of big cold histories for the [mem] line: a burst of
    # them queues there instead of competing with the event loop for cores and the GIL
    counting: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="memgate-count"))
    pool: UpstreamPool = field(default_factory=UpstreamPool)
    refused: RefusedSessions = field(default_factory=RefusedSessions)
    log: Any = None
    keyless_seen: bool = False  # a request without a usable key was said once (handlers)
    # called with (the [mem] fields, the decision or None, what happened on the wire) after
    # each [mem] line: the console and tracing read requests here, the request path never
    # waits on them (an observer that raises is logged once per request and skipped)
    observers: list[Callable[[dict[str, Any], Any, Any], None]] = field(default_factory=list)
    # OpenTelemetry (gateway.observe.otel.Tracing): `tracing` once set up, `tracer` while on (None
    # when off: all a request then pays is that test)
    tracing: Any = None
    tracer: Any = None
    console: Console | None = None  # console.enabled: its observer is in `observers`

    @property
    def rules(self) -> Rules:
        return self.reloader.rules

    @property
    def history_cache(self) -> HistoryCache | None:
        """The per-session history cache, or None when configured off (size 0)."""
        return self.history if self.history.max_entries else None


STATE = web.AppKey("memgate_state", GatewayState)
