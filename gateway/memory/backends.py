"""Health of the gateway's optional backends: the Redis session state and the memory store.

A backend that fails degrades its feature, never the request (ARCHITECTURE: never worse
than no gateway). Every call goes through a `Backend`: a failure (an exception or the
time bound) is counted per operation, logged at most once per `log_every_s` per
operation with the number of failures not logged since, and opens a breaker: for
`retry_after_s` the backend is not called at all, so a backend that is down costs a
request nothing; then one call at a time is let through to find out whether it is back.
Callers catch `BackendDown` and mark what they could not get as missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

RETRY_AFTER_S = 5.0
LOG_EVERY_S = 60.0


class BackendDown(Exception):
    """The backend failed this call, or was skipped because it failed recently."""


def iso_utc(wall: float) -> str:
    """A wall-clock time for /readyz: 2026-12-01T15:22:58Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


class Backend:
    """A circuit breaker with counted, rate-limited failures for one backend."""

    def __init__(
        self,
        name: str,
        log: Callable[[], Any],
        retry_after_s: float = RETRY_AFTER_S,
        log_every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._log = log  # a callable: a reload that changes the log format swaps the logger
        self.retry_after_s = retry_after_s
        self.log_every_s = log_every_s
        self._clock = clock
        self.errors: dict[str, int] = {}  # op -> failures (memgate_backend_errors_total)
        self.skipped = 0  # calls not made while the breaker was open
        self._open_until = 0.0  # monotonic; 0: closed
        self._probing = False  # a call is finding out whether the backend is back
        self._logged: dict[str, tuple[float, int]] = {}  # op -> (last logged, not logged since)
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # wall clock
        self.last_ok_at: float | None = None

    @property
    def up(self) -> bool:
        return self._open_until == 0.0

    async def call(
        self, op: str, make: Callable[[], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """`await make()` within `timeout_s`, or BackendDown (counted, maybe logged)."""
        probe = False
        if self._open_until:
            if self._probing or self._clock() < self._open_until:
                self.skipped += 1
                raise BackendDown(f"{self.name} is down (tried again "
                                  f"{self.retry_after_s:g}s after its last failure)")
            probe = self._probing = True  # this call finds out; the others still skip
        try:
            async with asyncio.timeout(timeout_s):
                result = await make()
        except Exception as exc:  # whatever a backend raises degrades its feature
            self._failed(op, exc)
            raise BackendDown(f"{self.name} {op}: {type(exc).__name__}") from exc
        finally:
            if probe:
                self._probing = False
        self._open_until = 0.0
        self.last_ok_at = time.time()
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        """Count a failure, open the breaker, log it unless this op was logged lately."""
        now = self._clock()
        self.errors[op] = self.errors.get(op, 0) + 1
        self._open_until = now + self.retry_after_s
        detail = str(exc)[:200] or ("timed out" if isinstance(exc, TimeoutError) else "")
        self.last_error = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
        self.last_error_at = time.time()
        last, unlogged = self._logged.get(op, (None, 0))
        if last is not None and now - last < self.log_every_s:
            self._logged[op] = (last, unlogged + 1)
            return
        self._logged[op] = (now, 0)
        self._log().error("backend_error", backend=self.name, op=op, error=type(exc).__name__,
                          detail=detail, suppressed=unlogged,
                          retry_after_s=self.retry_after_s)

    def status(self) -> dict[str, Any]:
        """This backend's part of /readyz."""
        out: dict[str, Any] = {"status": "ok" if self.up else "down",
                               "errors": sum(self.errors.values())}
        if self.last_error is not None and self.last_error_at is not None:
            out["last_error"] = self.last_error
            out["last_error_at"] = iso_utc(self.last_error_at)
        if self.last_ok_at is not None:
            out["last_ok_at"] = iso_utc(self.last_ok_at)
        if not self.up:
            out["retry_in_s"] = round(max(0.0, self._open_until - self._clock()), 2)
        return out
