"""run_async: the event loop every command runs on (serve, demo, the offline tools).

Its own module so that the commands beside `cli` (demo) use it without importing `cli`,
which imports them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run on uvloop when it is installed, else asyncio's default loop."""
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    except ImportError:
        return asyncio.run(main())
