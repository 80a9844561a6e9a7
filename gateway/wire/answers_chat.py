"""OpenAI chat completions' answers while memgate answers its retrieval tool
(`gateway.wire.answers`): `choices[0].message` and its `tool_calls`, or the
`chat.completion.chunk` stream (`data:` events ending with `data: [DONE]`).

The client's one answer: round 1's id and created time on every chunk, the rounds'
content one after another, the client's own tool calls numbered on across rounds
(`tool_calls[].index` from 0 without gaps), the last round's finish reason and one usage
chunk summing every round's (only when the upstream sent usage: `stream_options`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from gateway.wire.answers import (
    Call,
    Round,
    SseRounds,
    loads_object,
    rounds_usage,
    sse,
)

_DONE = b"data: [DONE]\n\n"


def _message(answer: dict[str, Any]) -> dict[str, Any]:
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    return message if isinstance(message, dict) else {}


def _name(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def _turn(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class ChatAnswers:
    """`Answers` for OpenAI chat completions."""

    def read(self, answer: dict[str, Any], name: str) -> Round:
        message = _message(answer)
        calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        ours = [Call(str(c.get("id", "")), str(c["function"].get("arguments") or ""))
                for c in calls if _name(c) == name]
        content = message.get("content")
        return Round(ours=ours, others=len(calls) - len(ours),
                     turn=_turn(content if isinstance(content, str) else None, calls),
                     usage=answer.get("usage"))

    def merge(self, answers: list[dict[str, Any]], name: str, end: bool = False
              ) -> dict[str, Any]:
        out = copy.deepcopy(answers[0])
        texts = [m.get("content") for m in map(_message, answers)]
        calls = [c for m in map(_message, answers) for c in m.get("tool_calls") or []
                 if _name(c) != name]
        usage = rounds_usage(answers)
        choice = out["choices"][0]
        message = choice["message"]
        message["content"] = "".join(t for t in texts if isinstance(t, str)) or None
        if calls:
            message["tool_calls"] = copy.deepcopy(calls)
        else:
            message.pop("tool_calls", None)
        last = answers[-1]["choices"][0]
        choice["finish_reason"] = "stop" if end else last.get("finish_reason")
        if usage is not None:
            out["usage"] = usage
        return out

    def stream(self, name: str) -> ChatStream:
        return ChatStream(name)


@dataclass(slots=True)
class _Call:
    index: int  # the client's index (a retrieval call's is not used)
    id: str
    name: str
    ours: Call | None  # the retrieval call it is
    arguments: list[str] = field(default_factory=list)


class ChatStream(SseRounds):
    """`StreamMerge` for chat completion chunks."""

    def __init__(self, name: str) -> None:
        self._first: dict[str, Any] | None = None  # round 1's id, created, model
        self._base = 0  # the client's calls in the rounds before
        self._kept = 0  # the client's calls in this round
        self._finish: dict[str, Any] | None = None  # the held finish chunk
        self._usage_chunk: dict[str, Any] | None = None  # the held usage chunk
        super().__init__(name)

    def _start_round(self) -> None:
        self._base += self._kept
        self._kept = 0
        self._calls: dict[int, _Call] = {}
        self._text: list[str] = []

    def _event(self, raw: bytes, kind: str, data: bytes) -> bytes:
        if data.strip() == b"[DONE]":
            self.ended = True
            if self.ours:
                self.held = True
                return b""
            self.done = True
            return raw
        chunk = loads_object(data)
        if chunk is None:
            return raw
        if self._first is None:
            self._first = {k: chunk[k] for k in ("id", "object", "created", "model")
                           if k in chunk}
        changed = False
        if self.round > 1:
            for k in ("id", "created"):
                if k in chunk and k in self._first and chunk[k] != self._first[k]:
                    chunk[k] = self._first[k]
                    changed = True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if isinstance(choice, dict):
            changed = self._choice(chunk, choice) or changed
            if changed and not _carries(chunk, choice):
                return b""  # it held only the retrieval call, or round 2's role
        elif isinstance(usage, dict) and self.ours:
            self._usage_chunk = chunk
            return b""
        if isinstance(usage, dict) and self.round > 1 and not self.ours:
            chunk["usage"] = self.all_usage()
            changed = True
        return sse(chunk, named=False) if changed else raw

    def _choice(self, chunk: dict[str, Any], choice: dict[str, Any]) -> bool:
        """Take the retrieval calls out of a chunk's choice, number the client's on, hold
        the finish reason once the round called the tool: changed?"""
        changed = False
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            delta = {}
        if self.round > 1 and "role" in delta:  # accumulators append a repeated role
            del delta["role"]
            changed = True
        if isinstance(delta.get("content"), str):
            self._text.append(delta["content"])
        calls = delta.get("tool_calls")
        if isinstance(calls, list) and calls:
            kept = [c for c in map(self._call, calls) if c is not None]
            changed = changed or len(kept) != len(calls) or kept != calls
            if kept:
                delta["tool_calls"] = kept
            else:
                del delta["tool_calls"]
        if choice.get("finish_reason") and self.ours:
            held = copy.deepcopy(chunk)
            held["choices"][0]["delta"] = {}
            self._finish = held
            choice["finish_reason"] = None
            chunk.pop("usage", None)  # it comes summed at the end
            changed = True
        return changed

    def _call(self, delta: Any) -> dict[str, Any] | None:
        """One tool-call delta as the client gets it (None: the retrieval tool's)."""
        if not isinstance(delta, dict) or not isinstance(delta.get("index"), int):
            return delta if isinstance(delta, dict) else None
        call = self._calls.get(delta["index"])
        if call is None:
            name = _name(delta)
            call_id = str(delta.get("id", ""))
            ours = Call(call_id, "") if name == self.name else None
            if ours is not None:
                self.ours.append(ours)
            call = _Call(self._base + self._kept, call_id, str(name or ""), ours)
            self._kept += ours is None
            self.others += ours is None
            self._calls[delta["index"]] = call
        function = delta.get("function")
        piece = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(piece, str):
            call.arguments.append(piece)
            if call.ours is not None:
                call.ours.arguments += piece
        if call.ours is not None:
            return None
        return delta if delta["index"] == call.index else {**delta, "index": call.index}

    def _turn(self) -> list[dict[str, Any]]:
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": "".join(c.arguments)}}
                 for _, c in sorted(self._calls.items())]
        return _turn("".join(self._text), calls)

    def _closing(self, end: bool) -> bytes:
        first = self._first or {}
        finish = self._finish or {**first, "choices": [
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]}
        finish.update({k: first[k] for k in ("id", "created") if k in first})
        if end:
            finish["choices"][0]["finish_reason"] = "stop"
        if isinstance(finish.get("usage"), dict):  # an upstream that sends usage with it
            finish["usage"] = self.all_usage()
        out = [sse(finish, named=False)]
        if self._usage_chunk is not None:
            usage = {**self._usage_chunk, "usage": self.all_usage()}
            usage.update({k: first[k] for k in ("id", "created") if k in first})
            out.append(sse(usage, named=False))
        return b"".join(out) + _DONE


def _carries(chunk: dict[str, Any], choice: dict[str, Any]) -> bool:
    """Does a chunk whose calls were taken out still carry something for the client?"""
    delta = choice.get("delta")
    return bool(choice.get("finish_reason") or chunk.get("usage") or choice.get("logprobs")
                or (isinstance(delta, dict) and any(v not in (None, "", []) for v in
                                                    delta.values())))


CHAT_ANSWERS = ChatAnswers()
