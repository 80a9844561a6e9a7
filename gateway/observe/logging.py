r"""structlog setup and the `[mem]` line renderer.

One `[mem]` line per intercepted request. Console: `[mem] k=v ... ts=...` with the
seed document's fields first, in its order. JSON: the same keys, one object,
`event: "mem"`. Other events (startup, reloads) use the same renderers
(`2026-12-01T17:31:40.123Z info listening host=...`). The console timestamp is UTC to
the millisecond; on a [mem] line it is the last field (`... req=... ts=...`), so
`^\[mem\] ` still finds the request lines, the seed's fields keep their places and
k=v parsers read it as one more field.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import MutableMapping
from json.encoder import encode_basestring_ascii as _ascii_json
from typing import Any, TextIO

import orjson
import structlog

MEM_FIELDS = (
    "session", "turn", "hist_msgs", "hist_chars", "est_tokens", "budget_tokens",
    "evict", "kept", "dropped", "pinned",
    "mode", "model", "status", "upstream_ms", "overhead_ms", "req",
)
_MEM_SET = frozenset(MEM_FIELDS)
_SKIP = frozenset({"event", "level", "timestamp"})
# a value is bare only when it is printable ASCII without space, quote or '='; any
# other is written as an ASCII-only JSON string: a client's CR, LF, ESC, NEL, U+2028 or
# bidi override cannot start a line of its own or repaint the terminal (log forging)
_QUOTED = re.compile(r'[^!-~]|["=]')
# fields every line of this process carries (`worker=1` under `serve --workers N`): set
# before configure(), kept across the reconfigure a reload does
_PROCESS_FIELDS: dict[str, Any] = {}


def set_process_fields(**fields: Any) -> None:
    """Fields added to every log line of this process from the next configure() on."""
    _PROCESS_FIELDS.clear()
    _PROCESS_FIELDS.update(fields)


def _add_process_fields(_l: Any, _n: str, ev: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ev.update(_PROCESS_FIELDS)
    return ev


def _value(v: Any) -> str:
    t = type(v)
    if t is int:
        return str(v)
    if t is str:
        return v if v and _QUOTED.search(v) is None else _ascii_json(v)
    if v is None:
        return "-"
    if t is bool:
        return "true" if v else "false"
    if t is float:
        return f"{v:.2f}"
    s = str(v)
    if not s or _QUOTED.search(s) is not None:
        return _ascii_json(s)
    return s


class ConsoleRenderer:
    """`[mem] session=... turn=... ts=...` for mem events, `ts level event k=v` for
    the rest (ts when a timestamp processor ran)."""

    def __call__(self, _logger: Any, _name: str, ev: MutableMapping[str, Any]) -> str:
        event = ev.get("event", "")
        ts = ev.get("timestamp")
        if event == "mem":
            keys = [k for k in MEM_FIELDS if k in ev]
            keys += [k for k in ev if k not in _SKIP and k not in _MEM_SET]
            line = "[mem] " + " ".join(f"{k}={_value(ev[k])}" for k in keys)
            return line if ts is None else f"{line} ts={ts}"
        head = f"{ev.get('level', 'info')} {event}" if ts is None else (
            f"{ts} {ev.get('level', 'info')} {event}")
        rest = " ".join(f"{k}={_value(v)}" for k, v in ev.items() if k not in _SKIP)
        return f"{head} {rest}".rstrip()


class UtcStamp:
    """`timestamp`: UTC, milliseconds, Z (the seconds part formatted once per second)."""

    def __init__(self) -> None:
        self._second, self._text = -1, ""

    def __call__(self, _l: Any, _n: str, ev: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        ev["timestamp"] = f"{self._text}.{int((now - second) * 1000):03d}Z"
        return ev


class JsonRenderer:
    def __call__(self, _logger: Any, _name: str, ev: MutableMapping[str, Any]) -> str:
        return orjson.dumps(dict(ev), default=str).decode()


class LineLogger(structlog.PrintLogger):
    """structlog's PrintLogger writing each line and its newline in one write: print()
    writes them apart, and through stderr (write-through) the workers of `serve
    --workers N`, sharing it, interleaved their lines."""

    def msg(self, message: str) -> None:
        with self._lock:
            self._file.write(message + "\n")
            self._file.flush()

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


class LineLoggerFactory:
    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> LineLogger:
        return LineLogger(self._file)


def configure(
    fmt: str = "console",
    level: str = "info",
    stream: TextIO | None = None,
    sink: list[dict[str, Any]] | None = None,
) -> None:
    """Configure structlog once per process (serve, demo, CLI).

    `sink`, when given, also receives a copy of every `mem` event (the demo's table).
    """
    renderer: Any = JsonRenderer() if fmt == "json" else ConsoleRenderer()
    processors: list[Any] = [structlog.processors.add_log_level]
    if _PROCESS_FIELDS:
        processors.append(_add_process_fields)
    if sink is not None:

        def capture(_l: Any, _n: str, ev: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
            if ev.get("event") == "mem":
                sink.append(dict(ev))
            return ev

        processors.append(capture)
    if fmt == "json":
        processors.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    else:
        processors.append(UtcStamp())
    processors.append(renderer)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=LineLoggerFactory(stream or sys.stderr),
        # a logger obtained after configure() keeps this pipeline; reconfiguring
        # (a reload that changes the format) hands out new loggers
        cache_logger_on_first_use=True,
    )


def get_logger() -> Any:
    """A logger bound to the pipeline configure() set up last (not a lazy proxy, which
    looks the configuration up again on every call: 14 -> 9 us per [mem] line)."""
    return structlog.get_logger("memgate").bind()
