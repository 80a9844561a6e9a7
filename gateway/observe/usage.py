"""The provider's own token counts (`usage`), read from the answer as it is relayed.

Nothing of the answer is held beyond a bound: an event stream is read line by line
and a line is kept whole only up to LINE_BYTES (past that, its first HEAD_BYTES and
last TAIL_BYTES); a JSON body whole up to BODY_BYTES, else its last TAIL_BYTES. A
`usage` object sits at the end of every provider's answer, so a cut one is found by
scanning the kept tail for its last `"usage": {`. A compressed answer (the relay
passes it as it came) is inflated here for reading only, at most INFLATE_BYTES in
all and INFLATE_PIECE at a time: each piece is read before the next is inflated, so
a small chunk that inflates to megabytes (a deflate bomb) never lies in memory whole.

The counts are normalised to four keys, the same on every wire:
  input       every prompt token the provider read: OpenAI's prompt_tokens /
              input_tokens (cached ones included), Anthropic's input_tokens +
              cache_read_input_tokens + cache_creation_input_tokens (Anthropic's
              input_tokens alone excludes both)
  cached      of those, read from the provider's prompt cache
  output      completion_tokens / output_tokens
  cache_write Anthropic only: cache_creation_input_tokens
A key is present only when the provider sent its number.

Read on the way, at no extra parse: the answer's `model` and `id` (the provider's, e.g.
a dated snapshot of the model asked for): a JSON answer's top-level ones (of a cut one,
the first in its head), a chat stream's first event, Anthropic's message_start, the
Responses final event.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

LINE_BYTES = 262_144  # an SSE line (one event's data) kept whole up to this
BODY_BYTES = 262_144  # a JSON answer kept whole up to this
HEAD_BYTES = 512  # of a longer line: its start, which names the event's type
TAIL_BYTES = 65_536  # of a longer line or body: its end, where `usage` is
INFLATE_BYTES = 64 * 1024 * 1024  # a compressed answer is read for usage up to this
INFLATE_PIECE = 65_536  # inflated at a time (then read) from one compressed chunk

_USAGE_KEY = b'"usage"'
_WS = b" \t\r\n"
_GZIP = 16 + zlib.MAX_WBITS
_CODINGS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": zlib.MAX_WBITS}
# the Responses events that carry the finished response (and its usage)
_RESPONSE_ENDS = frozenset(("response.completed", "response.incomplete", "response.failed"))
_RESPONSE_END_HEADS = tuple(f'"{t}"'.encode() for t in _RESPONSE_ENDS)

Counts = dict[str, int]
IDENT_CHARS = 256  # of a model name or id read from an answer
# a string-valued "model" / "id" key in a cut answer's head (escapes kept: decoded after)
_IDENT_KEY = re.compile(rb'"(model|id)"[ \t\r\n]*:[ \t\r\n]*"((?:[^"\\]|\\.){1,1024})"')
# the [mem] line's names (read by observers: keep them)
LOG_NAMES = {"input": "usage_in", "cached": "usage_cached", "output": "usage_out",
             "cache_write": "usage_cache_write"}


def _ints(src: Any, keys: Mapping[str, str]) -> Counts:
    """The integer fields of `src` named in `keys` (provider name -> ours)."""
    if not isinstance(src, dict):
        return {}
    return {ours: v for theirs, ours in keys.items()
            if isinstance(v := src.get(theirs), int) and not isinstance(v, bool) and v >= 0}


_OPENAI_CHAT = {"prompt_tokens": "input", "completion_tokens": "output"}
_OPENAI_RESPONSES = {"input_tokens": "input", "output_tokens": "output"}
_ANTHROPIC = {"input_tokens": "input_tokens", "output_tokens": "output",
              "cache_read_input_tokens": "cached", "cache_creation_input_tokens": "cache_write"}


def chat_usage(usage: Any) -> Counts:
    got = _ints(usage, _OPENAI_CHAT)
    if got and isinstance(usage, dict):
        got.update(_ints(usage.get("prompt_tokens_details"), {"cached_tokens": "cached"}))
    return got


def responses_usage(usage: Any) -> Counts:
    got = _ints(usage, _OPENAI_RESPONSES)
    if got and isinstance(usage, dict):
        got.update(_ints(usage.get("input_tokens_details"), {"cached_tokens": "cached"}))
    return got


def anthropic_usage(usage: Any) -> Counts:
    """Anthropic's fields as sent (input_tokens kept apart): `normalise` sums them."""
    return _ints(usage, _ANTHROPIC)


def normalise(got: Counts) -> Counts | None:
    """The four keys of the module docstring; None when the provider sent nothing."""
    if "input_tokens" in got:  # Anthropic's: input is every prompt token read
        got = dict(got)
        got["input"] = (got.pop("input_tokens") + got.get("cached", 0)
                        + got.get("cache_write", 0))
    return {k: got[k] for k in ("input", "cached", "output", "cache_write") if k in got} or None


# --------------------------------------------------------------------------- per wire
# `body(obj)`: usage of a whole JSON answer; `event(obj)`: usage carried by one SSE
# event's data (later events' numbers replace earlier ones, key by key)

def _chat_event(obj: Any) -> Counts:
    return chat_usage(obj.get("usage")) if isinstance(obj, dict) else {}


def _responses_event(obj: Any) -> Counts:
    if not isinstance(obj, dict) or obj.get("type") not in _RESPONSE_ENDS:
        return {}
    response = obj.get("response")
    return responses_usage(response.get("usage")) if isinstance(response, dict) else {}


def _anthropic_event(obj: Any) -> Counts:
    if not isinstance(obj, dict):
        return {}
    kind = obj.get("type")
    if kind == "message_start":  # input and cache counts; output_tokens is a first 1
        message = obj.get("message")
        return anthropic_usage(message.get("usage")) if isinstance(message, dict) else {}
    if kind == "message_delta":  # cumulative: the last one is the answer's
        return anthropic_usage(obj.get("usage"))
    return {}


def _usage_of(extract: Callable[[Any], Counts]) -> Callable[[Any], Counts]:
    return lambda obj: extract(obj.get("usage")) if isinstance(obj, dict) else {}


def _top_ident(obj: Any) -> tuple[Any, Any]:
    return (obj.get("model"), obj.get("id")) if isinstance(obj, dict) else (None, None)


def _responses_ident(obj: Any) -> tuple[Any, Any]:
    if not isinstance(obj, dict) or obj.get("type") not in _RESPONSE_ENDS:
        return None, None
    return _top_ident(obj.get("response"))


def _anthropic_ident(obj: Any) -> tuple[Any, Any]:
    if not isinstance(obj, dict) or obj.get("type") != "message_start":
        return None, None
    return _top_ident(obj.get("message"))


# (model, id) of one SSE event's data, by wire (a JSON answer's are its top-level keys)
_EVENT_IDENT: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "openai_chat": _top_ident, "openai_responses": _responses_ident,
    "anthropic_messages": _anthropic_ident}


def head_ident(head: bytes) -> tuple[str | None, str | None]:
    """The first string "model" and "id" in the head of a cut answer or event (the keys
    every provider writes before its content); None for one not there."""
    found: dict[bytes, str] = {}
    for m in _IDENT_KEY.finditer(head):
        if m.group(1) not in found:
            try:
                found[m.group(1)] = orjson.loads(b'"' + m.group(2) + b'"')
            except orjson.JSONDecodeError:
                continue
    return found.get(b"model"), found.get(b"id")


def _ident_text(v: Any) -> str | None:
    return v[:IDENT_CHARS] if isinstance(v, str) and v else None


WIRES: dict[str, tuple[Callable[[Any], Counts], Callable[[Any], Counts]]] = {
    "openai_chat": (_usage_of(chat_usage), _chat_event),
    "openai_responses": (_usage_of(responses_usage), _responses_event),
    "anthropic_messages": (_usage_of(anthropic_usage), _anthropic_event),
}
# a usage object found in a cut line or body, by wire: how to read it
_FOUND = {"openai_chat": chat_usage, "openai_responses": responses_usage,
          "anthropic_messages": anthropic_usage}


# --------------------------------------------------------------------------- scanning

def last_usage_object(tail: bytes) -> Any:
    """The JSON object after the last `"usage":` in `tail` that parses (a cut body's
    end); None when there is none. A key inside a JSON string has its quotes escaped,
    so only a real key (or a string value "usage", whose next byte is no `:`) matches."""
    end = len(tail)
    while (at := tail.rfind(_USAGE_KEY, 0, end)) >= 0:
        end = at
        i = at + len(_USAGE_KEY)
        while i < len(tail) and tail[i] in _WS:
            i += 1
        if i >= len(tail) or tail[i] != 0x3A:  # ':'
            continue
        i += 1
        while i < len(tail) and tail[i] in _WS:
            i += 1
        close = _object_end(tail, i)
        if close is None:
            continue
        try:
            return orjson.loads(tail[i:close])
        except orjson.JSONDecodeError:
            continue
    return None


def _object_end(buf: bytes, start: int) -> int | None:
    """The index after the JSON object opening at `start` (None: no object, or cut)."""
    if start >= len(buf) or buf[start] != 0x7B:  # '{'
        return None
    depth, i, n = 0, start, len(buf)
    while i < n:
        c = buf[i]
        if c == 0x22:  # a string: to its closing quote, escapes skipped
            i += 1
            while i < n and buf[i] != 0x22:
                i += 2 if buf[i] == 0x5C else 1
        elif c == 0x7B or c == 0x5B:
            depth += 1
        elif c == 0x7D or c == 0x5D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class _Bounded:
    """One growing byte string kept whole up to `whole` bytes, else its first HEAD_BYTES
    and its last TAIL_BYTES."""

    __slots__ = ("cut", "head", "parts", "size", "tail", "whole")

    def __init__(self, whole: int) -> None:
        self.whole = whole
        self.parts: list[bytes] = []
        self.size = 0
        self.cut = False
        self.head = b""
        self.tail = b""

    def add(self, data: bytes) -> None:
        self.size += len(data)
        if not self.cut:
            self.parts.append(data)
            if self.size <= self.whole:
                return
            joined = b"".join(self.parts)
            self.cut, self.parts = True, []
            self.head, self.tail = joined[:HEAD_BYTES], joined[-TAIL_BYTES:]
            return
        self.tail = (self.tail + data)[-TAIL_BYTES:] if len(data) < TAIL_BYTES \
            else data[-TAIL_BYTES:]

    def value(self) -> bytes:
        return b"".join(self.parts)


# --------------------------------------------------------------------------- readers

class UsageReader:
    """Fed every relayed chunk of one answer; `result()` is its normalised usage, after
    which `model` and `id` are the answer's (None: not sent, or not read)."""

    def __init__(self, wire: str, sse: bool, encoding: str | None = None) -> None:
        self._body, self._event = WIRES[wire]
        self._found = _FOUND[wire]
        self._ident = _EVENT_IDENT[wire]
        self.model: str | None = None
        self.id: str | None = None
        # a chat stream names its model on every event, usage on the last one only (and
        # only with include_usage): its first event is read for them
        self._first_event = sse and wire == "openai_chat"
        self._wire = wire
        self._sse = sse
        self._got: Counts = {}
        self._inflate = Inflate.for_encoding(encoding)
        self._broken = False  # a compressed answer that could not be read: no usage
        self._line = _Bounded(LINE_BYTES)
        self._doc = _Bounded(BODY_BYTES)

    def feed(self, chunk: bytes) -> None:
        """Never raises: reading usage must not break the relay of the answer."""
        if self._broken:
            return
        try:
            if self._inflate is None:
                self._read(chunk)
            else:
                for piece in self._inflate.feed(chunk):
                    self._read(piece)
        except Exception:  # noqa: BLE001 - a corrupt or odd answer just has no usage
            self._broken = True

    def _read(self, data: bytes) -> None:
        if self._sse:
            self._lines(data)
        else:
            self._doc.add(data)

    def _lines(self, chunk: bytes) -> None:
        """Lines are judged whole; only the unfinished last one is carried to the next
        chunk. Whole lines inside the chunk are looked at only when the chunk holds a
        `"usage"` key at all (most events of a stream do not)."""
        last = chunk.rfind(b"\n")
        if last < 0:
            self._line.add(chunk)
            return
        start = 0
        if self._line.size:  # the line the last chunk left unfinished ends here
            start = chunk.find(b"\n")
            self._line.add(chunk[:start])
            line, self._line = self._line, _Bounded(LINE_BYTES)
            if line.cut:
                self._cut_line(line.head, line.tail)
            else:
                self._whole_line(line.value())
            start += 1
        if start < last and (self._first_event or chunk.find(_USAGE_KEY, start, last) >= 0):
            for data in chunk[start:last].split(b"\n"):
                if len(data) > LINE_BYTES:
                    self._cut_line(data[:HEAD_BYTES], data[-TAIL_BYTES:])
                else:
                    self._whole_line(data)
        if last + 1 < len(chunk):
            self._line.add(chunk[last + 1:])

    def _whole_line(self, data: bytes) -> None:
        if not data.startswith(b"data:"):
            return
        if self._first_event:
            self._first_event = False
            if _USAGE_KEY not in data:
                try:
                    self._named(*self._ident(orjson.loads(data[5:])))
                except orjson.JSONDecodeError:
                    pass
                return
        if _USAGE_KEY not in data:
            return
        # OpenAI chat with include_usage sends `"usage":null` on every chunk but the last
        if data.count(_USAGE_KEY) == 1 and b'"usage":null' in data:
            return
        if self._wire == "openai_responses" and not self._final_event(data[:HEAD_BYTES]):
            return  # response.created and the like echo the request: not parsed
        try:
            obj = orjson.loads(data[5:])
        except orjson.JSONDecodeError:
            return
        self._got.update(self._event(obj))
        self._named(*self._ident(obj))

    def _named(self, model: Any, ident: Any) -> None:
        """The answer's model and id: the first ones read stay."""
        if self.model is None:
            self.model = _ident_text(model)
        if self.id is None:
            self.id = _ident_text(ident)

    def _cut_line(self, head: bytes, tail: bytes) -> None:
        """A line too long to hold counts only for Responses' final events (the data's
        first key is its type); the chat and Anthropic events that carry usage are
        small, so a long one's tail would hold another object's `usage`."""
        if (head.startswith(b"data:") and self._wire == "openai_responses"
                and self._final_event(head)):
            self._got.update(self._found(last_usage_object(tail)))
            self._named(*head_ident(head[head.find(b'"response"'):]))

    @staticmethod
    def _final_event(head: bytes) -> bool:
        return any(t in head for t in _RESPONSE_END_HEADS)

    def result(self) -> Counts | None:
        """The usage read so far (an answer cut short may still have sent it)."""
        if self._broken:
            return None
        try:
            return self._result()
        except Exception:  # noqa: BLE001 - as in feed
            return None

    def _result(self) -> Counts | None:
        if self._sse:
            line = self._line
            if line.size:  # a last line without its newline
                self._line = _Bounded(LINE_BYTES)
                if line.cut:
                    self._cut_line(line.head, line.tail)
                else:
                    self._whole_line(line.value())
            return normalise(self._got)
        doc = self._doc
        if not doc.cut:
            try:
                obj = orjson.loads(doc.value())
            except orjson.JSONDecodeError:
                return None
            self._named(*_top_ident(obj))
            return normalise(self._body(obj))
        self._named(*head_ident(doc.head))
        return normalise(self._found(last_usage_object(doc.tail)))


class TooBig(Exception):
    """A compressed answer inflates past INFLATE_BYTES: not read for usage."""


class Inflate:
    """Content-Encoding gzip / deflate undone for reading, in bounded pieces."""

    def __init__(self, wbits: int) -> None:
        self._wbits = wbits
        self._d: Any = None
        self._out = 0

    @classmethod
    def for_encoding(cls, header: str | None) -> Inflate | None:
        if not header:
            return None
        codings = [c.strip().lower() for c in header.split(",") if c.strip()]
        codings = [c for c in codings if c != "identity"]
        if not codings:
            return None
        if len(codings) != 1 or codings[0] not in _CODINGS:
            return Unreadable(0)
        return cls(_CODINGS[codings[0]])

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The inflated bytes of `chunk`, in pieces of at most INFLATE_PIECE bytes, each
        inflated only once the one before was taken."""
        while True:
            if self._d is None:
                if not chunk:
                    return
                wbits = self._wbits
                if wbits == zlib.MAX_WBITS and chunk[0] & 0x0F != 8:  # raw deflate
                    wbits = -zlib.MAX_WBITS
                self._d = zlib.decompressobj(wbits)
            part = self._d.decompress(chunk, INFLATE_PIECE)
            self._out += len(part)
            if self._out > INFLATE_BYTES:
                raise TooBig
            if part:
                yield part
            if self._d.eof:  # a gzip answer may hold several members
                chunk, self._d = self._d.unused_data, None
                continue
            chunk = self._d.unconsumed_tail
            # a full piece with all input taken may leave output inside zlib: ask again
            if not chunk and len(part) < INFLATE_PIECE:
                return


class Unreadable(Inflate):
    """An encoding not read (br, zstd, stacked codings): the answer has no usage."""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        raise TooBig


def reader_for(wire: str, status: int, headers: Mapping[str, str]) -> UsageReader | None:
    """A reader for an answer that can carry usage: a 2xx JSON or event stream of a
    known wire (an error answer has none)."""
    if wire not in WIRES or not 200 <= status < 300:
        return None
    ctype = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if ctype == "text/event-stream":
        sse = True
    elif ctype == "application/json" or ctype.endswith("+json"):
        sse = False
    else:
        return None
    return UsageReader(wire, sse, headers.get("Content-Encoding"))


def log_fields(usage: Counts | None) -> dict[str, int]:
    """The [mem] line's usage_* fields: only those the provider sent."""
    if not usage:
        return {}
    return {LOG_NAMES[k]: v for k, v in usage.items()}
