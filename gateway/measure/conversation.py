"""The neutral shape of a chat history: fixed part, turns, atomic groups.

A **turn** starts at a user message and runs to the next one. Inside a turn a
**group** is the smallest unit eviction may drop: the user message, a plain
assistant reply, or an assistant tool call together with all its results.
System/developer messages are **fixed**: never in a group, always kept.

Wire parsers (gateway/wire/) build a `Conversation`; the planner only ever sees
this shape. Nothing here does I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.measure.media import Media, Piece

META_KEY = "memgate"  # gateway metadata on a message: {"pin", "score", "ttl"}, never forwarded


class Unplannable(Exception):
    """The history is valid JSON but not something eviction may touch safely.

    The request is forwarded unchanged and logged `evict=skipped reason=<reason>`.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BadMetadata(ValueError):
    """Gateway metadata on a message is malformed: ignored and logged, or a 400 for the
    client with eviction on and `memory.markers.on_bad_metadata: reject`."""


@dataclass(frozen=True, slots=True)
class Pin:
    explicit: bool  # metadata pin: true or the text prefix
    score: float | None
    ttl: int | None


@dataclass(slots=True)
class Group:
    indices: list[int]
    turn: int  # 0 = before the first user message, then 1..n_turns
    is_user: bool
    chars: int = 0  # text the model reads (Conversation.text_chars): the max_chars budget
    weight: int = 0  # approx tokens, no tokenizer (places stepped cuts)
    pins: list[tuple[int, Pin]] = field(default_factory=list)  # (message index, pin)
    # the planner's token sum of the group's messages, valid for `tokens_key` (the
    # counter and scale it was counted with): a session's unchanged groups are the same
    # objects request after request (history.join), so they are summed once
    tokens: int = field(default=-1, compare=False, repr=False)
    tokens_key: Any = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class Conversation:
    n_messages: int
    fixed: list[int]
    groups: list[Group]
    n_turns: int
    chars: list[int]  # per message, the jq definition (logged hist_chars)
    # per message, the characters of the text the model reads, inline media payloads
    # excluded: what max_chars budgets (a 40 KB screenshot is not 40 K characters)
    text_chars: list[int] = field(default_factory=list)
    media_parts: int = 0  # images, audio, files, documents (costed by gateway.measure.media)
    media_tokens: int = 0  # their token cost, summed
    media_chars: int = 0  # characters of their inline payloads (in `chars`, not in text)
    has_metadata: bool = False
    outside_chars: int = 0  # always-kept text outside the list (Anthropic `system`, ...)
    # what the planner computed over a prefix of `groups` (checkpoints), shared by the
    # conversations a session's history cache joins from this one's head
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # the groups with pins, listed when first asked for (history.join extends the head's)
    pinned: list[int] | None = field(default=None, compare=False, repr=False)
    # the groups of more than one message that a user message does not open (a tool
    # call with its results), listed when first asked for (history.join extends them)
    tooled: list[int] | None = field(default=None, compare=False, repr=False)
    # messages carrying a provider prompt-cache breakpoint (wires with cache_markers)
    cache_marked: list[int] = field(default_factory=list)
    # the first turn of the caller's input since the model's last reply, when that input
    # began before the last turn (a document sent as its own user message, then the
    # question): those turns are all current (None: the last turn alone)
    current: int | None = None

    @property
    def first_current_turn(self) -> int:
        """The first turn never evicted: the current one, or where the input began."""
        return self.n_turns if self.current is None else self.current

    @property
    def total_chars(self) -> int:
        return sum(self.chars)

    @property
    def total_text_chars(self) -> int:
        return sum(self.text_chars)

    @property
    def pinned_groups(self) -> list[int]:
        """Indices of the groups that carry pins (active or not), ascending."""
        if self.pinned is None:
            self.pinned = [g for g, grp in enumerate(self.groups) if grp.pins]
        return self.pinned

    def group_of(self, i: int, end: int | None = None) -> int | None:
        """The group (among groups[:end]) holding item i; None for a fixed item or none."""
        groups = self.groups
        g = bisect.bisect_right(groups, i, 0, len(groups) if end is None else end,
                                key=lambda grp: grp.indices[0]) - 1
        return g if g >= 0 and i in groups[g].indices else None

    @property
    def tooled_groups(self) -> list[int]:
        """Indices of the groups that are not a user message's and hold more than one
        message (a tool call and its results), ascending."""
        if self.tooled is None:
            self.tooled = [g for g, grp in enumerate(self.groups)
                           if not grp.is_user and len(grp.indices) > 1]
        return self.tooled


def content_chars(content: Any) -> int:
    """Characters of one message content, as jq's `tostring | length` (null counts 0)."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return len(orjson.dumps(content).decode("utf-8"))


@dataclass(slots=True)
class Measure:
    """One item's parse-time sizes, from the pieces its wire says the model reads."""

    chars: int = 0  # text characters
    weight: int = 0  # approx tokens: fixed tokens + media cost + ~4 characters a token
    media: int = 0
    media_tokens: int = 0
    media_chars: int = 0

    def add_media(self, m: Measure) -> None:
        """Sum one item's media into a parse's running totals."""
        self.media += m.media
        self.media_tokens += m.media_tokens
        self.media_chars += m.media_chars


def measure(pieces: Iterable[Piece]) -> Measure:
    chars = weight = n = tokens = payload = 0
    for p in pieces:
        if type(p) is str:
            chars += len(p)
            weight += approx_tokens(p)
        elif type(p) is int:
            weight += p
        else:
            assert isinstance(p, Media)
            n += 1
            tokens += p.tokens
            payload += p.payload_chars
    return Measure(chars, weight + tokens, n, tokens, payload)


def approx_tokens(s: str) -> int:
    """~4 ASCII characters per token, ~1 token per CJK character; no tokenizer."""
    n = len(s)
    if s.isascii():
        return (n + 3) // 4
    wide = (len(s.encode("utf-8", "surrogatepass")) - n) // 2  # 3-byte chars count 1
    return (n - wide + 3) // 4 + wide


def str_fields(d: dict[str, Any], *keys: str) -> Iterator[str]:
    """The string values of these keys (what the model reads of an item's fields)."""
    for k in keys:
        v = d.get(k)
        if isinstance(v, str):
            yield v


def opens_with(content: Any, prefixes: tuple[str, ...]) -> bool:
    """Does the content's text, or one of its text parts, start with one of the prefixes
    (leading whitespace aside)? How a client's context message is told (Claude Code puts
    its reminders in text blocks before the prompt's)."""
    if not prefixes:
        return False
    if isinstance(content, str):
        return has_prefix(content, prefixes)
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str) and has_prefix(text, prefixes):
                    return True
    return False


def first_text(content: Any) -> str | None:
    """The text a pin prefix is looked for in: the string, or the first text part."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return str(part["text"])
    return None


def read_metadata(meta: Any, where: str) -> Pin | None:
    """Validate a message's `memgate` metadata: {pin, score, ttl}."""
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise BadMetadata(f"{where}: must be an object like {{\"pin\": true}}")
    unknown = set(meta) - {"pin", "score", "ttl"}
    if unknown:
        raise BadMetadata(f"{where}: unknown key {sorted(unknown)[0]!r} (allowed: pin, score, ttl)")
    pin = meta.get("pin", False)
    score = meta.get("score")
    ttl = meta.get("ttl")
    if not isinstance(pin, bool):
        raise BadMetadata(f"{where}.pin: must be true or false")
    if score is not None and (
        isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1
    ):
        raise BadMetadata(f"{where}.score: must be a number between 0 and 1")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0):
        raise BadMetadata(f"{where}.ttl: must be a non-negative integer (turns)")
    return Pin(explicit=pin, score=None if score is None else float(score), ttl=ttl)


def pin_of(meta_pin: Pin | None, text: str | None, prefix: str, min_score: float) -> Pin | None:
    """The effective pin of a message, or None."""
    by_prefix = bool(prefix) and text is not None and has_prefix(text, prefix)
    if meta_pin is None:
        return Pin(explicit=True, score=None, ttl=None) if by_prefix else None
    explicit = meta_pin.explicit or by_prefix
    scored = meta_pin.score is not None and meta_pin.score >= min_score
    if explicit or scored:
        return Pin(explicit=explicit, score=meta_pin.score, ttl=meta_pin.ttl)
    if meta_pin.score is not None:  # below threshold: still ranks in the score stage
        return Pin(explicit=False, score=meta_pin.score, ttl=meta_pin.ttl)
    return None


def has_prefix(text: str, prefix: str | tuple[str, ...]) -> bool:
    """text.lstrip().startswith(prefix) (one prefix or any of several), without copying
    the text when it starts with no whitespace."""
    return text.startswith(prefix) or (text[:1].isspace() and text.lstrip().startswith(prefix))


def message_pin(
    m: dict[str, Any], key: str, i: int, text: str | None, prefix: str, min_score: float
) -> tuple[Pin | None, bool]:
    """(effective pin, whether gateway metadata was present) of message `key[i]`."""
    meta = None
    has_meta = META_KEY in m
    if has_meta:
        meta = read_metadata(m[META_KEY], f"{key}[{i}].{META_KEY}")
    if meta is None and not (prefix and text and has_prefix(text, prefix)):
        return None, has_meta
    return pin_of(meta, text, prefix, min_score), has_meta


def merge_into(groups: list[Group], g: int, open_calls: dict[str, int]) -> None:
    """Results separated from their call by other messages: groups g..end become one
    atomic span (the call, what came between, and the results)."""
    merged = groups[g]
    for later in groups[g + 1 :]:
        merged.indices.extend(later.indices)
        merged.pins.extend(later.pins)
        merged.chars += later.chars
        merged.weight += later.weight
    del groups[g + 1 :]
    for k, v in open_calls.items():
        if v > g:
            open_calls[k] = g


def is_active(pin: Pin, own_turn: int, current_turn: int, min_score: float) -> bool:
    """Does this pin hold in the current turn (pinned, and its ttl not expired)?"""
    if not (pin.explicit or (pin.score is not None and pin.score >= min_score)):
        return False
    return pin.ttl is None or current_turn - own_turn <= pin.ttl
