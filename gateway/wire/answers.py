"""The upstream's answers while memgate answers its own retrieval tool (memory.retrieve).

When the forwarded request carries the retrieval tool and the model calls it, memgate
answers the call and asks the upstream again; the client gets one answer made of every
round, as if no retrieval had happened. This module reads one round's answer (which
calls it made) and merges the rounds into the client's answer, non-streaming
(`Answers.read`, `Answers.merge`) and streaming (`StreamMerge`), for each wire:
OpenAI chat completions, Anthropic messages, OpenAI Responses.

What the client sees (every wire):
- the retrieval tool's calls never: they are taken out of every round (the client's
  own tool calls stay, numbered without gaps);
- one answer: the first round's id (and model, created time), each round's content
  after the previous one's, the last round's stop reason, and `usage` the sum of every
  round's (every numeric field summed, nested ones too: never less than any round);
- streaming: one opening (`message_start` / the first chunk's role / `response.created`),
  content indices and output indices renumbered to run on without gaps across rounds,
  sequence numbers consecutive, and one end (`message_stop` / `[DONE]` /
  `response.completed`, which lists every round's kept output items).

Pure: no I/O, no logging, nothing about handles (the caller resolves the calls).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson


@dataclass(slots=True)
class Call:
    """One call of the retrieval tool in an answer."""

    id: str  # tool_use id / tool_call id / Responses call_id
    arguments: str  # the arguments' JSON text as the model wrote it ("" when none)


@dataclass(slots=True)
class Round:
    """One round's answer as the retrieval loop needs it."""

    ours: list[Call]  # calls of the retrieval tool, in order
    others: int  # calls of the client's own tools
    # the model's turn as history items to append to the next round's request, exactly
    # as the model produced it (our calls included; thinking blocks with their
    # signatures, reasoning items): chat [the assistant message]; Anthropic [the
    # assistant message]; Responses the output items
    turn: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None  # this round's usage as the upstream sent it


class StreamMerge(Protocol):
    """One client stream made of the rounds' event streams.

    Round 1's bytes go to `feed` as they arrive; `feed` returns what the client gets
    now. Until a retrieval call starts, bytes pass unchanged (a round that never calls
    the tool is relayed byte for byte); the call's events, and from the call on the
    round's closing events (stop reason, usage, the terminal event), are held. After
    the round's stream has ended, `round_end` says what it called. The loop then either
    answers and calls `next_round` before feeding the next round's bytes (whose opening
    events are dropped and whose numbering runs on), or ends the client's stream with
    `finish`."""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of the current round's stream as they came (any split), and what
        the client gets of them now."""
        ...

    def round_end(self) -> Round | None:
        """After the current round's stream has ended: its calls and turn; None when it
        held no retrieval call (everything was passed on already, the stream is done)
        or did not end with a terminal event."""
        ...

    def next_round(self) -> None:
        """The next round's bytes follow."""
        ...

    def finish(self, end: bool = False) -> bytes:
        """The held closing events for the client, once: usage summed over every round;
        the last round's stop reason, or with `end` the wire's plain end of a turn
        (end_turn / stop / completed: the last round called only the retrieval tool,
        which the client never sees, and no further round will run)."""
        ...


class Answers(Protocol):
    """One wire's answers."""

    def read(self, answer: dict[str, Any], name: str) -> Round:
        """A non-streaming answer: its calls of the tool `name`, and the rest."""
        ...

    def merge(self, answers: list[dict[str, Any]], name: str, end: bool = False
              ) -> dict[str, Any]:
        """The client's one answer from every round's (non-streaming), the calls of
        `name` taken out; `end` as in StreamMerge.finish."""
        ...

    def stream(self, name: str) -> StreamMerge:
        """A merge of streamed rounds, for the tool `name`."""
        ...


def rounds_usage(answers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Every round's `usage` summed (usage_sum); None when none sent any."""
    usage = None
    for answer in answers:
        usage = usage_sum(usage, answer.get("usage"))
    return usage


def usage_sum(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two rounds' usage as one: numbers added, nested objects summed alike; any other
    value (a service tier, a null) the first's, else the second's. A fresh dict."""
    if a is None:
        a, b = b, None
    if a is None:
        return None
    b = b or {}
    return {key: _leaf_sum(a.get(key), b.get(key)) for key in (*a, *(k for k in b if k not in a))}


def _leaf_sum(x: Any, y: Any) -> Any:
    if _is_number(x) and _is_number(y):
        return x + y
    if isinstance(x, dict) or isinstance(y, dict):
        return usage_sum(x if isinstance(x, dict) else None, y if isinstance(y, dict) else None)
    return x if x is not None else y


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# an SSE event ends at a blank line (LF or CRLF line ends; the APIs send LF)
_BLANK = re.compile(rb"\r\n\r\n|\n\n")


def take_events(buf: bytearray) -> list[bytes]:
    """The complete events at the start of `buf`, each with the blank line that ends it,
    taken out of `buf` (what is left is an event still arriving)."""
    events = []
    at = 0
    for m in _BLANK.finditer(buf):
        events.append(bytes(buf[at:m.end()]))
        at = m.end()
    del buf[:at]
    return events


def event_fields(raw: bytes) -> tuple[str, bytes]:
    """An event's type (its `event:` field, "" when none) and data (its `data:` lines)."""
    kind = ""
    data = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line.startswith(b"event:"):
            name = line[7:] if line.startswith(b"event: ") else line[6:]
            kind = name.decode("utf-8", "replace")
    return kind, b"\n".join(data)


def sse(value: dict[str, Any], named: bool) -> bytes:
    """One event carrying `value`; `named`: with an `event:` line of its type (Anthropic,
    Responses), else data only (chat)."""
    data = b"data: " + orjson.dumps(value) + b"\n\n"
    return b"event: " + str(value.get("type")).encode() + b"\n" + data if named else data


def loads_object(data: bytes) -> dict[str, Any] | None:
    """An event's data as a JSON object, None when it is not one."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class SseRounds:
    """What the three wires' `StreamMerge`s share: the rounds' bytes cut into events,
    round 1 relayed unparsed until the tool's name shows, the holding and the end.

    Round 1 is relayed as it comes, but for the tail of an event still arriving: a call's
    opening event may be split before the tool's name, and its first bytes must not have
    reached the client then. Its relayed bytes are kept (references, no copy) and read into
    the wire's state once the name shows (`_replay`): the turn and the numbering need
    what came before the call. A wire implements `_event` (one complete event: what the
    client gets of it), `_closing`, `_turn`, and `_start_round` (its per-round state; it
    carries the numbering on from the round before)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._needle = name.encode()
        self._buf = bytearray()  # the event still arriving
        self._relayed: list[bytes] | None = []  # round 1's relayed bytes, while unparsed
        self._parsing = False
        self.round = 1
        self.total: dict[str, Any] | None = None  # the earlier rounds' usage summed
        self.held = False  # closing events held for `finish`
        self.done = False  # the client's stream has had its end
        self.ours: list[Call] = []
        self.others = 0
        self.usage: dict[str, Any] | None = None
        self.ended = False  # this round's terminal event came
        self._shown = False  # some of this round reached the client
        self._start_round()

    def _start_round(self) -> None:
        raise NotImplementedError

    def _event(self, raw: bytes, kind: str, data: bytes) -> bytes:
        raise NotImplementedError

    def _closing(self, end: bool) -> bytes:
        raise NotImplementedError

    def _turn(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def feed(self, chunk: bytes) -> bytes:
        if not self._parsing:
            if not self._names_tool(chunk):
                return self._relay(chunk)
            self._replay()
        self._buf += chunk
        out = b"".join([self._event(raw, *event_fields(raw)) for raw in take_events(self._buf)])
        self._shown = self._shown or bool(out)
        return out

    def _names_tool(self, chunk: bytes) -> bool:
        """Does the tool's name show in `chunk`, or across its start?"""
        needle = self._needle
        if needle in chunk:
            return True
        keep = len(needle) - 1
        return bool(self._buf) and keep > 0 and needle in bytes(self._buf[-keep:]) + chunk[:keep]

    def _relay(self, chunk: bytes) -> bytes:
        buf = self._buf
        if not buf and chunk.endswith(b"\n\n"):  # the usual chunk: whole events
            out = chunk
        else:
            buf += chunk
            lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
            cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
            out = bytes(buf[:cut])
            del buf[:cut]
        if out and self._relayed is not None:
            self._relayed.append(out)
        return out

    def _replay(self) -> None:
        """Read round 1's relayed events into the state (what they gave the client is
        what it already has: nothing before a call changes)."""
        self._parsing = True
        relayed, self._relayed = self._relayed or [], None
        for raw in take_events(bytearray(b"".join(relayed))):
            self._event(raw, *event_fields(raw))

    def round_end(self) -> Round | None:
        self._relayed = None
        if not (self._parsing and self.ours and self.ended):
            return None
        return Round(ours=list(self.ours), others=self.others, turn=self._turn(),
                     usage=self.usage)

    def next_round(self) -> None:
        self.total = usage_sum(self.total, self.usage)
        self.round += 1
        self._parsing = True
        self._relayed = None
        self._buf.clear()
        self.ours = []
        self.others = 0
        self.usage = None
        self.ended = False
        self._shown = False
        self._start_round()

    def finish(self, end: bool = False) -> bytes:
        if self.done:
            return b""
        self.done = True
        if not self._parsing:  # relayed unparsed: only an unended last event is left
            out, self._buf = bytes(self._buf), bytearray()
            return out
        if self.held and (self.ended or not self._shown):
            return self._closing(end)
        # a round broken off after some of it went out: an end made up now could close
        # none of its open blocks or items well, so the client's stream stays as broken
        return b""

    def all_usage(self) -> dict[str, Any] | None:
        """Every round's usage summed, this one's included."""
        return usage_sum(self.total, self.usage)
