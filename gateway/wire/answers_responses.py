"""OpenAI Responses' answers while memgate answers its retrieval tool
(`gateway.wire.answers`): the response's `output` items, or its event stream
(`response.created`, items by `output_index`, `response.completed`), every event
numbered by `sequence_number`.

The client's one answer: round 1's `response.created` (and its id on every response
object), the rounds' output items one after another numbered from 0 without gaps, the
sequence numbers consecutive across rounds, and one `response.completed` (or the last
round's failed / incomplete) listing every round's kept items with every round's usage
summed."""

from __future__ import annotations

import copy
from typing import Any

from gateway.wire.answers import (
    Call,
    Round,
    SseRounds,
    loads_object,
    rounds_usage,
    sse,
)

# the output items the client runs (the retrieval tool's calls are function calls)
_CLIENT_CALLS = frozenset(("function_call", "custom_tool_call", "computer_call",
                           "local_shell_call", "shell_call", "apply_patch_call"))
_OPENING = frozenset(("response.created", "response.in_progress", "response.queued"))
_TERMINAL = frozenset(("response.completed", "response.failed", "response.incomplete"))
# a response's fields that come from the last round (the rest are the first round's)
_LAST = ("status", "incomplete_details", "error", "completed_at")


def _is_ours(item: Any, name: str) -> bool:
    return (isinstance(item, dict) and item.get("type") == "function_call"
            and item.get("name") == name)


def _is_client_call(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") in _CLIENT_CALLS


def _output(response: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in response.get("output") or [] if isinstance(i, dict)]


def _ended(response: dict[str, Any], end: bool) -> None:
    """`end`: the response ends as a plain completed one."""
    if end:
        response.update(status="completed", incomplete_details=None, error=None)


class ResponsesAnswers:
    """`Answers` for OpenAI Responses."""

    def read(self, answer: dict[str, Any], name: str) -> Round:
        output = _output(answer)
        ours = [Call(str(i.get("call_id", "")), str(i.get("arguments") or ""))
                for i in output if _is_ours(i, name)]
        calls = sum(map(_is_client_call, output))
        return Round(ours=ours, others=calls - len(ours), turn=output,
                     usage=answer.get("usage"))

    def merge(self, answers: list[dict[str, Any]], name: str, end: bool = False
              ) -> dict[str, Any]:
        out = copy.deepcopy(answers[0])
        out["output"] = [copy.deepcopy(i) for a in answers for i in _output(a)
                         if not _is_ours(i, name)]
        out.update({k: copy.deepcopy(answers[-1][k]) for k in _LAST if k in answers[-1]})
        _ended(out, end)
        usage = rounds_usage(answers)
        if usage is not None:
            out["usage"] = usage
        return out

    def stream(self, name: str) -> ResponsesStream:
        return ResponsesStream(name)


class ResponsesStream(SseRounds):
    """`StreamMerge` for Responses events."""

    def __init__(self, name: str) -> None:
        self._seq: int | None = None  # the client's next sequence number
        self._first: dict[str, Any] = {}  # round 1's id and created_at
        self._items: list[dict[str, Any]] = []  # the client's items of the ended rounds
        self._base = 0  # the client's items in the rounds before
        self._kept = 0  # the client's items in this round
        self._terminal: dict[str, Any] | None = None  # the held terminal event
        super().__init__(name)

    def _start_round(self) -> None:
        self._base += self._kept
        self._kept = 0
        self._index: dict[int, int | None] = {}  # output_index -> the client's (None: ours)
        self._turn_items: list[dict[str, Any]] = []

    def _event(self, raw: bytes, kind: str, data: bytes) -> bytes:
        event = loads_object(data)
        if event is None:
            return raw
        kind = event.get("type", kind)
        if kind in _OPENING:
            if self.round > 1:
                return b""
            response = event.get("response")
            if isinstance(response, dict) and not self._first:
                self._first = {k: response[k] for k in ("id", "created_at") if k in response}
            return self._numbered(raw, event, False)
        if kind in _TERMINAL:
            return self._end(raw, event)
        at = event.get("output_index")
        if not isinstance(at, int):
            if kind == "error":
                self.done = True
            return self._numbered(raw, event, False)
        if kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, dict) and _is_ours(item, self.name):
                self._index[at] = None
                self.ours.append(Call(str(item.get("call_id", "")),
                                      str(item.get("arguments") or "")))
            else:
                self._index[at] = self._base + self._kept
                self._kept += 1
                self.others += _is_client_call(item)
        index = self._index.get(at, self._base + at)
        if index is None:
            return b""
        changed = index != at
        event["output_index"] = index
        return self._numbered(raw, event, changed)

    def _numbered(self, raw: bytes, event: dict[str, Any], changed: bool) -> bytes:
        """The event as the client gets it: its sequence number the client's next."""
        seq = event.get("sequence_number")
        if isinstance(seq, int):
            if self._seq is None:
                self._seq = seq
            if seq != self._seq:
                event["sequence_number"] = self._seq
                changed = True
            self._seq += 1
        return sse(event, named=True) if changed else raw

    def _end(self, raw: bytes, event: dict[str, Any]) -> bytes:
        response = event.get("response")
        if not isinstance(response, dict):
            return self._numbered(raw, event, False)
        self.ended = True
        self.usage = response.get("usage")
        self._turn_items = _output(response)
        by_call = {c.id: c for c in self.ours}
        for item in self._turn_items:  # the arguments as they ended
            if _is_ours(item, self.name) and item.get("call_id") in by_call:
                by_call[item["call_id"]].arguments = str(item.get("arguments") or "")
        self._items += [i for i in self._turn_items if not _is_ours(i, self.name)]
        if self.ours:
            self._terminal = event
            self.held = True
            return b""
        self.done = True
        if self.round == 1:
            return self._numbered(raw, event, False)
        self._whole(response)
        return self._numbered(raw, event, True)

    def _whole(self, response: dict[str, Any]) -> None:
        """The last response object as the client gets it: every round's."""
        response.update(self._first)
        response["output"] = copy.deepcopy(self._items)
        usage = self.all_usage()
        if usage is not None:
            response["usage"] = usage

    def _turn(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._turn_items)

    def _closing(self, end: bool) -> bytes:
        event = self._terminal or {"type": "response.completed", "response": {}}
        response = event["response"]
        self._whole(response)
        if end:
            event["type"] = "response.completed"
            _ended(response, end)
        event["sequence_number"] = self._seq if self._seq is not None else 0
        return sse(event, named=True)


RESPONSES_ANSWERS = ResponsesAnswers()
