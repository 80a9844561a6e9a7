"""Anthropic messages' answers while memgate answers its retrieval tool
(`gateway.wire.answers`): the message's `content` blocks, or its event stream
(`message_start`, `content_block_start/delta/stop` by index, `message_delta`,
`message_stop`).

The client's one answer: round 1's `message_start`, the rounds' content blocks one after
another numbered from 0 without gaps, one `message_delta` with the last round's stop
reason and every round's usage summed (input, cache and output tokens: the SDKs take
the totals from there), one `message_stop`."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.wire.answers import (
    Call,
    Round,
    SseRounds,
    loads_object,
    rounds_usage,
    sse,
)

_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
# the usage fields a message_delta carries (cumulative: they replace message_start's)
_DELTA_USAGE = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                "output_tokens", "server_tool_use", "output_tokens_details")
_LAST = ("stop_reason", "stop_sequence", "stop_details")


def _is_ours(block: Any, name: str) -> bool:
    return (isinstance(block, dict) and block.get("type") == "tool_use"
            and block.get("name") == name)


def _is_client_call(block: Any) -> bool:
    return isinstance(block, dict) and block.get("type") == "tool_use"


class MessagesAnswers:
    """`Answers` for Anthropic messages."""

    def read(self, answer: dict[str, Any], name: str) -> Round:
        content = [b for b in answer.get("content") or [] if isinstance(b, dict)]
        ours = [Call(str(b.get("id", "")), orjson.dumps(b.get("input", {})).decode())
                for b in content if _is_ours(b, name)]
        calls = sum(map(_is_client_call, content))
        return Round(ours=ours, others=calls - len(ours),
                     turn=[{"role": "assistant", "content": content}],
                     usage=answer.get("usage"))

    def merge(self, answers: list[dict[str, Any]], name: str, end: bool = False
              ) -> dict[str, Any]:
        out = copy.deepcopy(answers[0])
        out["content"] = [copy.deepcopy(b) for a in answers for b in a.get("content") or []
                          if not _is_ours(b, name)]
        out.update({k: answers[-1][k] for k in _LAST if k in answers[-1]})
        if end:
            out.update(stop_reason="end_turn", stop_sequence=None)
            if "stop_details" in out:
                out["stop_details"] = None
        usage = rounds_usage(answers)
        if usage is not None:
            out["usage"] = usage
        return out

    def stream(self, name: str) -> MessagesStream:
        return MessagesStream(name)


@dataclass(slots=True)
class _Block:
    index: int  # the client's index (a retrieval call's is not used)
    block: dict[str, Any]  # as it started, the deltas added to it
    ours: Call | None  # the retrieval call it is
    json: list[str] = field(default_factory=list)  # a tool call's input as it came


class MessagesStream(SseRounds):
    """`StreamMerge` for Anthropic message events."""

    def __init__(self, name: str) -> None:
        self._base = 0  # the client's blocks in the rounds before
        self._kept = 0  # the client's blocks in this round
        self._delta: dict[str, Any] | None = None  # the held message_delta
        self._stop = _STOP  # the held message_stop
        super().__init__(name)

    def _start_round(self) -> None:
        self._base += self._kept
        self._kept = 0
        self._blocks: dict[int, _Block] = {}

    def _event(self, raw: bytes, kind: str, data: bytes) -> bytes:
        if kind == "ping":
            return raw
        event = loads_object(data)
        if event is None:
            return raw
        kind = event.get("type", kind)
        if kind == "message_start":
            message = event.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            self.usage = dict(usage) if isinstance(usage, dict) else None
            return raw if self.round == 1 else b""
        if kind == "content_block_start":
            return self._block_start(raw, event)
        if kind in ("content_block_delta", "content_block_stop"):
            block = self._blocks.get(event.get("index"))  # type: ignore[arg-type]
            if block is None:
                return raw
            if kind == "content_block_delta":
                _add_delta(block, event.get("delta"))
            return b"" if block.ours is not None else _numbered(raw, event, block.index)
        if kind == "message_delta":
            usage = event.get("usage")
            if isinstance(usage, dict):  # cumulative counts: they replace the start's
                self.usage = {**(self.usage or {}),
                              **{k: v for k, v in usage.items() if v is not None}}
            if self.ours:
                self._delta = event
                return b""
            if self.round == 1:
                return raw
            event["usage"] = self._usage(event.get("usage"))
            return sse(event, named=True)
        if kind == "message_stop":
            self.ended = True
            if self.ours:
                self.held = True
                self._stop = raw
                return b""
        if kind in ("message_stop", "error"):
            self.done = True
        return raw

    def _block_start(self, raw: bytes, event: dict[str, Any]) -> bytes:
        index = event.get("index")
        start = event.get("content_block")
        if not isinstance(index, int) or not isinstance(start, dict):
            return raw
        block = _Block(self._base + self._kept, copy.deepcopy(start), None)
        if _is_ours(start, self.name):
            block.ours = Call(str(start.get("id", "")), "")
            self.ours.append(block.ours)
        else:
            self._kept += 1
            self.others += _is_client_call(start)
        self._blocks[index] = block
        return b"" if block.ours is not None else _numbered(raw, event, block.index)

    def _usage(self, delta: Any) -> dict[str, Any]:
        """A final message_delta's usage: every round's summed."""
        total = self.all_usage() or {}
        usage = dict(delta) if isinstance(delta, dict) else {}
        usage.update({k: total[k] for k in _DELTA_USAGE if total.get(k) is not None})
        return usage

    def _turn(self) -> list[dict[str, Any]]:
        content = []
        for _, b in sorted(self._blocks.items()):
            block = copy.deepcopy(b.block)
            if b.json and "input" in block:
                try:
                    block["input"] = orjson.loads("".join(b.json))
                except orjson.JSONDecodeError:  # cut off (max_tokens): as it started
                    pass
            content.append(block)
        return [{"role": "assistant", "content": content}]

    def _closing(self, end: bool) -> bytes:
        event = self._delta or {"type": "message_delta",
                                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                "usage": {}}
        if end:
            event.setdefault("delta", {}).update(stop_reason="end_turn", stop_sequence=None)
        event["usage"] = self._usage(event.get("usage"))
        return sse(event, named=True) + self._stop


def _numbered(raw: bytes, event: dict[str, Any], index: int) -> bytes:
    """The event as the client gets it: at the client's block index."""
    if event.get("index") == index:
        return raw
    event["index"] = index
    return sse(event, named=True)


def _add_delta(block: _Block, delta: Any) -> None:
    """A content_block_delta added to its block (for the turn and the call)."""
    if not isinstance(delta, dict):
        return
    b = block.block
    kind = delta.get("type")
    if kind == "text_delta":
        b["text"] = str(b.get("text") or "") + str(delta.get("text", ""))
    elif kind == "thinking_delta":
        b["thinking"] = str(b.get("thinking") or "") + str(delta.get("thinking", ""))
    elif kind == "signature_delta":
        b["signature"] = delta.get("signature")
    elif kind == "citations_delta":
        b["citations"] = [*(b.get("citations") or []), delta.get("citation")]
    elif kind == "input_json_delta":
        piece = str(delta.get("partial_json", ""))
        block.json.append(piece)
        if block.ours is not None:
            block.ours.arguments += piece


MESSAGES_ANSWERS = MessagesAnswers()
