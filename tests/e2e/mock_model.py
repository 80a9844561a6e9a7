"""A mock model for the agent-CLI end-to-end suite: an aiohttp server that speaks Anthropic
Messages (POST /v1/messages, SSE or JSON) and OpenAI Responses (POST /v1/responses, SSE or
JSON), offline and deterministic.

It plays an agent. A request whose `tools` hold a shell tool (Claude Code's `Bash`, Codex's
`exec_command` / `shell` / `shell_command`) and whose last real user message names a task
(`TASK1`, `TASK2`) is answered with the next of that task's six tool calls, built from the
tool's own input schema, and after the sixth tool result with a final text
(`TASK1-DONE: ...`) made from what the tool results said. Where it is in a task comes from
the request alone: the tool calls since the task's user message. Anything else (titles,
summaries, quota checks, the start-up probes) gets a short plain answer.

It uses memgate's retrieval tool (memory.retrieve) as a model would: a task's request that
carries `memgate_retrieve` and names a handle (`handle "cmp-..."` / `handle "hist-..."`)
is answered, once per session and task, with a call of that tool instead of the step; the
next request (memgate's, the tool result appended) goes on with the step. The calls and
the results they got are in `MockModel.retrievals`; the retrieval calls and their results
count neither as steps nor as the task's tool outputs.

It checks what the real APIs check of a conversation's shape (`anthropic_problems`,
`responses_problems`: tool results paired with their calls, roles, reasoning placement)
and answers a body that breaks a rule with the provider's own 400 shape, as the real
upstream would; `MockModel.refused()` lists those requests.

Every request is recorded (method, path with query, headers, body bytes, parsed JSON) in
`MockModel.received`, for the tests' assertions and `probe.py`'s report.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

# recognisable lines of the scratch project (tests/e2e/harness.py writes them); the mock
# quotes them in its final answers only when a tool result showed them
README_MARK = "README-MARK-7731"
SRC_MARK = "SRC-MARK-4410"
CLAUDE_MD_MARK = "CLAUDE-MD-MARK-2048"
AGENTS_MD_MARK = "AGENTS-MD-MARK-5150"

TASK_RE = re.compile(r"\bTASK([12])\b")
RETRIEVE_TOOL = "memgate_retrieve"  # memory.retrieve.tool_name of the shipped config
HANDLE_RE = re.compile(r'handle "((?:cmp|hist)-[0-9a-f]+)"')
SHELL_TOOLS = ("Bash", "exec_command", "shell_command", "shell", "local_shell")
BACKGROUND_TEXT = "Mock model: nothing to do here."

# (kind, argument): "sh" runs a shell command, "read" reads a file of the project
# (Claude Code's Read tool, else `cat` through the shell)
STEPS: dict[str, list[tuple[str, str]]] = {
    "1": [
        ("sh", "ls -la"),
        ("read", "README.md"),
        ("sh", "cat src/app.py"),
        ("sh", "grep -rn MARK README.md src"),
        ("sh", "mkdir -p out && printf 'TASK1 wrote this line\\n' > out/task1.txt"),
        ("sh", "cat out/task1.txt && wc -l src/app.py"),
    ],
    "2": [
        ("sh", "ls out"),
        ("read", "out/task1.txt"),
        ("sh", "wc -c README.md"),
        ("sh", "printf 'TASK2 appended this line\\n' >> out/task1.txt"),
        ("sh", "cat out/task1.txt"),
        ("sh", "printf 'TASK2 done\\n' > out/task2.txt && ls out"),
    ],
}
ROUNDS = 6


@dataclass
class Recorded:
    """One request as the mock received it."""

    seq: int
    t: float
    method: str
    path: str  # with the query string
    headers: list[tuple[str, str]]
    raw: bytes
    body: Any  # parsed JSON, or None
    api: str  # "anthropic" | "responses" | "other"
    role: str = "other"  # "agent" (a task step), "background" (plain answer), "other"
    task: str | None = None
    round: int | None = None
    answer: str = ""  # a short description of what was answered
    call_id: str | None = None  # the id of the tool call answered, if any
    refusal: str | None = None  # the 400's message when the body broke a provider rule

    def header(self, name: str) -> str | None:
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return None


@dataclass
class Retrieval:
    """One call of memgate's retrieval tool the mock made, and the result it got back."""

    session: str  # the client's session id header ("" without one)
    task: str
    handle: str
    call_id: str
    seq: int  # the request answered with the call
    result: str | None = None  # the tool result's text, once a request brought it
    result_seq: int | None = None


@dataclass
class Step:
    """What the mock answers: one tool call, or a final / plain text."""

    text: str | None = None
    tool: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    kind: str = "function"  # Responses: function | custom (a freeform tool)


# ---------------------------------------------------------------------------- helpers


def _text_of(content: Any) -> str:
    """All text in a message content / tool output (strings, blocks, nested lists)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_of(c) for c in content)
    if isinstance(content, dict):
        parts = [content.get(k) for k in ("text", "output", "content", "input_text")]
        return "\n".join(_text_of(p) for p in parts if p is not None)
    return ""


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside a parsed JSON value, depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings_in(v)


def named_handles(body: dict[str, Any]) -> list[str]:
    """The retrieval handles the conversation names (markers, the carry note), in order;
    the tool definitions are not read."""
    out: list[str] = []
    for key, value in body.items():
        if key != "tools":
            for text in strings_in(value):
                out += [h for h in HANDLE_RE.findall(text) if h not in out]
    return out


def _schema_props(schema: Any) -> dict[str, Any]:
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        props: dict[str, Any] = schema["properties"]
        return props
    return {}


def shell_args(name: str, schema: Any, command: str, cwd: str | None) -> dict[str, Any]:
    """Arguments for the client's shell tool, shaped by its declared schema."""
    props = _schema_props(schema)
    if "cmd" in props:  # Codex exec_command
        args: dict[str, Any] = {"cmd": command}
    elif props.get("command", {}).get("type") == "array" or name in ("shell", "local_shell"):
        args = {"command": ["bash", "-lc", command]}
    else:  # Claude Code Bash, Codex shell_command
        args = {"command": command}
    if "workdir" in props and cwd:
        args["workdir"] = cwd
    if "description" in props:
        args["description"] = f"mock step: {command[:40]}"
    if "timeout_ms" in props and name != "Bash":
        args["timeout_ms"] = 30000
    return args


def final_answer(task: str, outputs: str, history: str) -> str:
    """The task's final text, from what its tool results showed (and, for TASK2, whether
    the first task's answer is still in the history the model was sent)."""
    if task == "1":
        readme = README_MARK if README_MARK in outputs else "missing"
        src = SRC_MARK if SRC_MARK in outputs else "missing"
        wrote = "yes" if "TASK1 wrote this line" in outputs else "no"
        return f"TASK1-DONE: readme={readme} src={src} wrote_out_task1={wrote}"
    appended = "yes" if "TASK2 appended this line" in outputs else "no"
    seen = "yes" if "TASK1-DONE:" in history else "no"
    return f"TASK2-DONE: appended={appended} task1_answer_in_history={seen}"


# ---------------------------------------------------------------------------- the agent


def anthropic_step(body: dict[str, Any], cwd: str | None) -> tuple[str, Step, str | None, int]:
    """(role, step, task, round) for an Anthropic Messages request."""
    tools = {t.get("name"): t for t in body.get("tools") or [] if isinstance(t, dict)}
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    start = None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        blocks = m.get("content") if isinstance(m.get("content"), list) else []
        if m.get("role") == "user" and not any(
                isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
            start = i
            break
    shell = next((n for n in SHELL_TOOLS if n in tools), None)
    task = None
    if start is not None:
        found = TASK_RE.findall(_text_of(messages[start].get("content")))
        task = found[-1] if found else None
    if shell is None or task is None or start is None:
        return "background", Step(text=BACKGROUND_TEXT), None, 0
    after = messages[start + 1:]
    ours = {b.get("id") for m in after for b in _blocks(m.get("content"))
            if b.get("type") == "tool_use" and b.get("name") == RETRIEVE_TOOL}
    rounds = sum(1 for m in after if m.get("role") == "assistant" and any(
        b.get("type") == "tool_use" and b.get("id") not in ours
        for b in _blocks(m.get("content"))))
    if rounds >= ROUNDS:
        outputs = "\n".join(
            _text_of([b for b in _blocks(m.get("content")) if b.get("tool_use_id") not in ours]
                     if isinstance(m.get("content"), list) else m.get("content"))
            for m in after if m.get("role") == "user")
        history = "\n".join(_text_of(m.get("content")) for m in messages[:start])
        return "agent", Step(text=final_answer(task, outputs, history)), task, rounds
    kind, arg = STEPS[task][rounds]
    if kind == "read" and "Read" in tools and cwd:
        return "agent", Step(tool="Read", args={"file_path": f"{cwd}/{arg}"}), task, rounds
    command = arg if kind == "sh" else f"cat {arg}"
    args = shell_args(shell, tools[shell].get("input_schema"), command, cwd)
    return "agent", Step(tool=shell, args=args), task, rounds


def _is_task_message(item: dict[str, Any]) -> bool:
    return item.get("type", "message") == "message" and item.get("role") == "user" and bool(
        TASK_RE.search(_text_of(item.get("content"))))


def responses_step(body: dict[str, Any], cwd: str | None) -> tuple[str, Step, str | None, int]:
    """(role, step, task, round) for an OpenAI Responses request."""
    tools: dict[str, dict[str, Any]] = {}
    for t in body.get("tools") or []:
        if isinstance(t, dict):
            name = t.get("name") or t.get("type")
            if isinstance(name, str):
                tools[name] = t
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    items = [i for i in items or [] if isinstance(i, dict)]
    start = None
    for i in range(len(items) - 1, -1, -1):
        if _is_task_message(items[i]):
            start = i
            break
    shell = next((n for n in SHELL_TOOLS if n in tools), None)
    task = None
    if start is not None:
        found = TASK_RE.findall(_text_of(items[start].get("content")))
        task = found[-1] if found else None
    if shell is None or task is None or start is None:
        return "background", Step(text=BACKGROUND_TEXT), None, 0
    after = items[start + 1:]
    calls = ("function_call", "custom_tool_call", "local_shell_call")
    ours = {i.get("call_id") for i in after
            if i.get("type") == "function_call" and i.get("name") == RETRIEVE_TOOL}
    rounds = sum(1 for i in after if i.get("type") in calls and i.get("call_id") not in ours)
    if rounds >= ROUNDS:
        outputs = "\n".join(_text_of(i.get("output")) for i in after
                            if str(i.get("type", "")).endswith("_output")
                            and i.get("call_id") not in ours)
        history = "\n".join(_text_of(i.get("content")) for i in items[:start]
                            if i.get("type", "message") == "message")
        return "agent", Step(text=final_answer(task, outputs, history)), task, rounds
    kind, arg = STEPS[task][rounds]
    command = arg if kind == "sh" else f"cat {arg}"
    spec = tools[shell]
    schema = spec.get("parameters") or spec.get("input_schema")
    return "agent", Step(tool=shell, args=shell_args(shell, schema, command, cwd)), task, rounds


# ---------------------------------------------------------------------------- provider rules


def _blocks(content: Any) -> list[dict[str, Any]]:
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def anthropic_problems(body: Any) -> list[str]:
    """What the Anthropic Messages API would refuse in this body (its 400 messages): no
    messages, a first message not the user's, a `tool_result` not answering a `tool_use` of
    the assistant turn right before it, a `tool_use` left unanswered by the user turn after
    it, `thinking` blocks outside assistant turns. Consecutive messages of one role are one
    turn, as the API merges them."""
    if not isinstance(body, dict):
        return ["body: not a JSON object"]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["messages: at least one message is required"]
    first = messages[0]
    problems = []
    if not isinstance(first, dict) or first.get("role") != "user":
        problems.append("messages.0.role: the first message must use the `user` role")
    # turns: (role, index of the turn's first message, [(message index, block index, block)])
    turns: list[tuple[str, int, list[tuple[int, int, dict[str, Any]]]]] = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            problems.append(f"messages.{i}.role: must be `user` or `assistant`")
            continue
        assert isinstance(m, dict)
        blocks = [(i, j, b) for j, b in enumerate(_blocks(m.get("content")))]
        if turns and turns[-1][0] == role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((role, i, blocks))
    for k, (role, _, blocks) in enumerate(turns):
        if role != "user":
            continue
        before = turns[k - 1] if k > 0 and turns[k - 1][0] == "assistant" else None
        uses = [str(b.get("id")) for _, _, b in (before[2] if before else [])
                if b.get("type") == "tool_use"]
        answered = set()
        for i, j, b in blocks:
            kind = b.get("type")
            if kind == "tool_result":
                tid = str(b.get("tool_use_id"))
                answered.add(tid)
                if tid not in uses:
                    problems.append(
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {tid}. Each `tool_result` block must have a "
                        "corresponding `tool_use` block in the previous message.")
            elif kind in ("thinking", "redacted_thinking"):
                problems.append(f"messages.{i}.content.{j}: `{kind}` blocks may only appear "
                                "in `assistant` messages")
        missing = [u for u in uses if u not in answered]
        if before is not None and missing:
            problems.append(
                f"messages.{before[1]}: `tool_use` ids were found without `tool_result` "
                f"blocks immediately after: {', '.join(missing)}. Each `tool_use` block must "
                "have a corresponding `tool_result` block in the next message.")
    return problems


# a Responses tool output type -> the call type it answers
RESPONSES_OUTPUTS = {"function_call_output": "function_call",
                     "custom_tool_call_output": "custom_tool_call"}


def responses_problems(body: Any) -> list[str]:
    """What the OpenAI Responses API would refuse in this body's `input`: an output whose
    call (same `call_id`) is not earlier in `input`, a call followed by more input but
    never by its output, a `reasoning` item last. (With `previous_response_id` the calls
    may live in the stored response: outputs are then not checked against `input`.)"""
    if not isinstance(body, dict):
        return ["body: not a JSON object"]
    items = body.get("input")
    if items is None or isinstance(items, str):
        return []
    if not isinstance(items, list):
        return ["input: must be a string or an array of items"]
    problems = []
    calls: dict[str, tuple[str, int]] = {}  # call_id -> (call type, index)
    outputs: dict[tuple[str, str], int] = {}  # (call type, call_id) -> last output index
    chained = bool(body.get("previous_response_id"))
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind, cid = item.get("type", "message"), str(item.get("call_id"))
        if kind in RESPONSES_OUTPUTS.values():
            calls[cid] = (kind, n)
        elif kind in RESPONSES_OUTPUTS:
            want = RESPONSES_OUTPUTS[kind]
            outputs[(want, cid)] = n
            if calls.get(cid, ("", 0))[0] != want and not chained:
                problems.append(f"input[{n}]: No tool call found for {kind.replace('_', ' ')}"
                                f" with call_id {cid}.")
    for cid, (kind, n) in calls.items():
        if n < len(items) - 1 and outputs.get((kind, cid), -1) < n:
            problems.append(f"input[{n}]: No tool output found for {kind.replace('_', ' ')}"
                            f" {cid}.")
    last = items[-1] if items else None
    if isinstance(last, dict) and last.get("type") == "reasoning":
        problems.append(f"input[{len(items) - 1}]: Item '{last.get('id')}' of type 'reasoning'"
                        " was provided without its required following item.")
    return problems


def anthropic_refusal(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


def openai_refusal(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": None}}


# ---------------------------------------------------------------------------- wire formats


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _chunks(text: str, n: int = 3) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def anthropic_message(step: Step, model: str, mid: str, tid: str, in_tokens: int
                      ) -> dict[str, Any]:
    if step.tool:
        content = [{"type": "tool_use", "id": tid, "name": step.tool, "input": step.args}]
        stop = "tool_use"
    else:
        content = [{"type": "text", "text": step.text or ""}]
        stop = "end_turn"
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": in_tokens, "output_tokens": 12,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def anthropic_events(msg: dict[str, Any]) -> Iterator[bytes]:
    start = {**msg, "content": [], "stop_reason": None,
             "usage": {**msg["usage"], "output_tokens": 1}}
    yield _sse("message_start", {"type": "message_start", "message": start})
    for idx, block in enumerate(msg["content"]):
        if block["type"] == "tool_use":
            yield _sse("content_block_start", {
                "type": "content_block_start", "index": idx,
                "content_block": {**block, "input": {}}})
            for part in _chunks(json.dumps(block["input"])):
                yield _sse("content_block_delta", {
                    "type": "content_block_delta", "index": idx,
                    "delta": {"type": "input_json_delta", "partial_json": part}})
        else:
            yield _sse("content_block_start", {
                "type": "content_block_start", "index": idx,
                "content_block": {"type": "text", "text": ""}})
            for part in _chunks(block["text"]):
                yield _sse("content_block_delta", {
                    "type": "content_block_delta", "index": idx,
                    "delta": {"type": "text_delta", "text": part}})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": idx})
    yield _sse("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": msg["stop_reason"], "stop_sequence": None},
        "usage": {"output_tokens": msg["usage"]["output_tokens"]}})
    yield _sse("message_stop", {"type": "message_stop"})


def responses_item(step: Step, iid: str, cid: str) -> dict[str, Any]:
    if step.tool:
        return {"type": "function_call", "id": iid, "call_id": cid, "name": step.tool,
                "arguments": json.dumps(step.args), "status": "completed"}
    return {"type": "message", "id": iid, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": step.text or "", "annotations": []}]}


def responses_object(rid: str, model: str, status: str, output: list[dict[str, Any]],
                     in_tokens: int, request: dict[str, Any]) -> dict[str, Any]:
    """A response object; like the real API's, it echoes the request's tools and
    tool_choice (so a client sees the tools a gateway added)."""
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": status,
        "error": None, "incomplete_details": None, "model": model, "output": output,
        "parallel_tool_calls": False, "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "usage": {"input_tokens": in_tokens, "output_tokens": 12,
                  "total_tokens": in_tokens + 12,
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}}
        if status == "completed" else None,
    }


def responses_events(rid: str, model: str, item: dict[str, Any], in_tokens: int,
                     request: dict[str, Any]) -> Iterator[bytes]:
    seq = itertools.count()
    yield _sse("response.created", {"type": "response.created", "sequence_number": next(seq),
                                    "response": responses_object(rid, model, "in_progress",
                                                                 [], in_tokens, request)})
    yield _sse("response.in_progress", {
        "type": "response.in_progress", "sequence_number": next(seq),
        "response": responses_object(rid, model, "in_progress", [], in_tokens, request)})
    if item["type"] == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        yield _sse("response.output_item.added", {
            "type": "response.output_item.added", "sequence_number": next(seq),
            "output_index": 0, "item": added})
        for part in _chunks(item["arguments"]):
            yield _sse("response.function_call_arguments.delta", {
                "type": "response.function_call_arguments.delta", "sequence_number": next(seq),
                "item_id": item["id"], "output_index": 0, "delta": part})
        yield _sse("response.function_call_arguments.done", {
            "type": "response.function_call_arguments.done", "sequence_number": next(seq),
            "item_id": item["id"], "output_index": 0, "arguments": item["arguments"]})
    else:
        text = item["content"][0]["text"]
        yield _sse("response.output_item.added", {
            "type": "response.output_item.added", "sequence_number": next(seq),
            "output_index": 0, "item": {**item, "status": "in_progress", "content": []}})
        empty = {"type": "output_text", "text": "", "annotations": []}
        yield _sse("response.content_part.added", {
            "type": "response.content_part.added", "sequence_number": next(seq),
            "item_id": item["id"], "output_index": 0, "content_index": 0, "part": empty})
        for part in _chunks(text):
            yield _sse("response.output_text.delta", {
                "type": "response.output_text.delta", "sequence_number": next(seq),
                "item_id": item["id"], "output_index": 0, "content_index": 0,
                "delta": part, "logprobs": []})
        yield _sse("response.output_text.done", {
            "type": "response.output_text.done", "sequence_number": next(seq),
            "item_id": item["id"], "output_index": 0, "content_index": 0, "text": text,
            "logprobs": []})
        yield _sse("response.content_part.done", {
            "type": "response.content_part.done", "sequence_number": next(seq),
            "item_id": item["id"], "output_index": 0, "content_index": 0,
            "part": {**empty, "text": text}})
    yield _sse("response.output_item.done", {
        "type": "response.output_item.done", "sequence_number": next(seq),
        "output_index": 0, "item": item})
    yield _sse("response.completed", {
        "type": "response.completed", "sequence_number": next(seq),
        "response": responses_object(rid, model, "completed", [item], in_tokens, request)})


# ---------------------------------------------------------------------------- the server


class MockModel:
    """The mock model server. `cwd` is the scratch project's directory: Claude Code's Read
    tool takes absolute paths, and Codex's exec_command a `workdir`."""

    def __init__(self, cwd: str | None = None, models: tuple[str, ...] = ("mock-model",)
                 ) -> None:
        self.cwd = cwd
        self.models = models
        self.received: list[Recorded] = []
        self.retrievals: list[Retrieval] = []
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self.url = ""

    # ---- lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 28)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_route("*", "/{tail:.*}", self.anything)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- recording

    async def _record(self, request: web.Request, api: str) -> Recorded:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        rec = Recorded(seq=len(self.received), t=time.time(), method=request.method,
                       path=request.path_qs, headers=list(request.headers.items()),
                       raw=raw, body=body, api=api)
        self.received.append(rec)
        return rec

    def refused(self) -> list[Recorded]:
        """The chat requests answered with a 400 because their body broke a provider rule."""
        return [r for r in self.received if r.refusal is not None]

    def _refuse(self, rec: Recorded, problems: list[str]) -> web.Response | None:
        if not problems:
            return None
        rec.role, rec.refusal = "refused", "; ".join(problems)
        rec.answer = f"400:{rec.refusal[:60]}"
        if rec.api == "anthropic":
            return web.json_response(anthropic_refusal(rec.refusal), status=400,
                                     headers={"request-id": f"req_mock_refused{rec.seq:04d}"})
        return web.json_response(openai_refusal(rec.refusal), status=400)

    def chat_requests(self, api: str | None = None) -> list[Recorded]:
        return [r for r in self.received if r.api != "other" and (api is None or r.api == api)]

    # ---- memgate's retrieval tool

    def _answer(self, rec: Recorded, body: dict[str, Any], step: Step, call_id: str) -> Step:
        """The step answered (`call_id`: the id a tool call gets), noted on `rec`."""
        step = self._retrieve(rec, body, step, call_id)
        rec.answer = f"tool:{step.tool}" if step.tool else f"text:{(step.text or '')[:60]}"
        rec.call_id = call_id if step.tool else None
        return step

    def _retrieve(self, rec: Recorded, body: dict[str, Any], step: Step, call_id: str
                  ) -> Step:
        """Note the results of the mock's retrieval calls this request brings; then the
        step, or, for a task's first request (per session) that carries the retrieval tool
        and names a handle, a call of that tool (rec.role "retrieve")."""
        items = body.get("messages", body.get("input"))
        for item in items if isinstance(items, list) else []:
            for part in [item, *_blocks(item.get("content"))] if isinstance(item, dict) else []:
                if part.get("type") not in ("tool_result", "function_call_output"):
                    continue
                cid = part.get("tool_use_id", part.get("call_id"))
                for r in self.retrievals:
                    if r.call_id == cid and r.result is None:
                        r.result = _text_of(part.get("content", part.get("output")))
                        r.result_seq = rec.seq
        session = rec.header("X-Claude-Code-Session-Id") or rec.header("session-id") or ""
        done = {(r.session, r.task) for r in self.retrievals}
        handles = named_handles(body)
        tools = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
        if (rec.role != "agent" or rec.task is None or RETRIEVE_TOOL not in tools
                or not handles or (session, rec.task) in done):
            return step
        self.retrievals.append(Retrieval(session, rec.task, handles[0], call_id, rec.seq))
        rec.role = "retrieve"
        return Step(tool=RETRIEVE_TOOL, args={"handle": handles[0]})

    # ---- handlers

    async def anything(self, request: web.Request) -> web.StreamResponse:
        rec = await self._record(request, "other")
        rec.answer = "harmless"
        if request.method == "HEAD":
            return web.Response(status=200)
        if request.method == "GET" and request.path in ("/", ""):
            return web.json_response({"ok": True})
        return web.json_response({"error": {"type": "not_found_error",
                                            "message": "mock model: no such route"}},
                                 status=404)

    async def list_models(self, request: web.Request) -> web.Response:
        rec = await self._record(request, "other")
        rec.answer = "models"
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "mock",
                 "type": "model", "display_name": m, "created_at": "2025-01-01T00:00:00Z"}
                for m in self.models]
        return web.json_response({"object": "list", "data": data, "models": data,
                                  "has_more": False, "first_id": self.models[0],
                                  "last_id": self.models[-1]})

    async def count_tokens(self, request: web.Request) -> web.Response:
        rec = await self._record(request, "other")
        rec.answer = "count_tokens"
        return web.json_response({"input_tokens": max(1, len(rec.raw) // 4)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        rec = await self._record(request, "anthropic")
        if refused := self._refuse(rec, anthropic_problems(rec.body)):
            return refused
        body = rec.body if isinstance(rec.body, dict) else {}
        rec.role, step, rec.task, rec.round = anthropic_step(body, self.cwd)
        n = next(self._ids)
        step = self._answer(rec, body, step, f"toolu_mock{n:04d}")
        msg = anthropic_message(step, str(body.get("model", "mock-model")), f"msg_mock{n:04d}",
                                f"toolu_mock{n:04d}", max(1, len(rec.raw) // 4))
        if not body.get("stream"):
            return web.json_response(msg, headers={"request-id": f"req_mock{n:04d}"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "request-id": f"req_mock{n:04d}"})
        await resp.prepare(request)
        for ev in anthropic_events(msg):
            await resp.write(ev)
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    async def responses(self, request: web.Request) -> web.StreamResponse:
        rec = await self._record(request, "responses")
        if refused := self._refuse(rec, responses_problems(rec.body)):
            return refused
        body = rec.body if isinstance(rec.body, dict) else {}
        rec.role, step, rec.task, rec.round = responses_step(body, self.cwd)
        n = next(self._ids)
        step = self._answer(rec, body, step, f"call_mock{n:04d}")
        model = str(body.get("model", "mock-model"))
        item = responses_item(step, f"{'fc' if step.tool else 'msg'}_mock{n:04d}",
                              f"call_mock{n:04d}")
        rid = f"resp_mock{n:04d}"
        in_tokens = max(1, len(rec.raw) // 4)
        if not body.get("stream"):
            return web.json_response(responses_object(rid, model, "completed", [item],
                                                      in_tokens, body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for ev in responses_events(rid, model, item, in_tokens, body):
            await resp.write(ev)
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp


async def _main() -> None:  # python -m tests.e2e.mock_model [port]: serve until killed
    import sys

    model = MockModel(cwd=sys.argv[2] if len(sys.argv) > 2 else None)
    url = await model.start(port=int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(f"mock model listening on {url}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main())
