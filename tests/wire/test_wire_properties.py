"""The eviction invariants for Anthropic Messages and OpenAI Responses bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.rules import build_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.measure.tokens import Tokenizers
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.openai_responses import OPENAI_RESPONSES
from tests.policy.test_policy_properties import assert_dropped_listing
from tests.strategies import conversation, memory_rules, to_anthropic, to_responses

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(50_000)


def make_rules(memory: dict[str, Any]) -> Rules:
    return build_rules({"memory": memory, "tokens": {"models_file": "rules/models.yaml"}},
                       base_dir=ROOT)


def strip(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k != "memgate"}


@pytest.mark.slow
@given(msgs=conversation(), memory=memory_rules())
@settings()
def test_anthropic_invariants(msgs: list[dict[str, Any]], memory: dict[str, Any]) -> None:
    """Anthropic: subsequence (recalled history before the current turn), system untouched,
    current turn kept, tool_use <-> tool_result pairs whole, first message from the user,
    idempotent."""
    body = to_anthropic(msgs)
    raw = orjson.dumps(body)
    d = decide(raw, orjson.loads(raw), make_rules(memory), TOK, ANTHROPIC_MESSAGES)
    assert d.plan is not None, d.skip_reason
    out = orjson.loads(d.forward)
    assert out["system"] == body["system"]
    src = body["messages"]
    assert out["messages"] == [strip(src[i]) for i in d.forwarded()]
    assert_dropped_listing(d.plan)
    assert set(d.plan.kept) | {i for i, _ in d.plan.dropped} == set(range(len(src)))
    assert d.cache_marker_dropped == any(  # from the parse's list of marked messages
        ANTHROPIC_MESSAGES.has_cache_marker(src[i]) for i, _ in d.plan.dropped)
    # breakpoints keep their order (recall moves no marked message): a client's valid
    # order of TTLs (1h entries before 5m ones) stays valid
    marked = [i for i in d.forwarded() if ANTHROPIC_MESSAGES.has_cache_marker(src[i])]
    assert marked == sorted(marked)
    # the caller's input since the model's last reply (the user messages ending the list,
    # tool results too) is one turn for the API, from the user message opening it
    run = len(src)
    while run and src[run - 1]["role"] == "user":
        run -= 1
    opener = max(i for i, m in enumerate(src[: run + 1]) if m["role"] == "user" and not any(
        b.get("type") == "tool_result" for b in m["content"]))
    assert set(range(opener, len(src))) <= set(d.plan.kept)
    uses = {b["id"] for m in out["messages"] for b in m["content"] if b["type"] == "tool_use"}
    results = {b["tool_use_id"] for m in out["messages"] for b in m["content"]
               if b["type"] == "tool_result"}
    assert uses == results
    for j, m in enumerate(out["messages"]):
        ids = [b["tool_use_id"] for b in m["content"] if b["type"] == "tool_result"]
        if ids:  # results answer the assistant message right before them
            prev = out["messages"][j - 1]
            assert prev["role"] == "assistant"
            assert set(ids) <= {b["id"] for b in prev["content"] if b["type"] == "tool_use"}
    assert out["messages"][0]["role"] == "user"
    again = decide(d.forward, out, make_rules(memory), TOK, ANTHROPIC_MESSAGES)
    if not any("memgate" in m for m in src):
        assert again.plan is not None and again.plan.dropped == ()


@pytest.mark.slow
@given(msgs=conversation(), memory=memory_rules())
@settings()
def test_responses_invariants(msgs: list[dict[str, Any]], memory: dict[str, Any]) -> None:
    """Responses: subsequence, current turn kept, call_id pairs whole, each reasoning item
    kept with the call it precedes, first non-system item from the user."""
    body = to_responses(msgs)
    raw = orjson.dumps(body)
    d = decide(raw, orjson.loads(raw), make_rules(memory), TOK, OPENAI_RESPONSES)
    assert d.plan is not None, d.skip_reason
    src = body["input"]
    out = orjson.loads(d.forward)["input"]
    assert out == [strip(src[i]) for i in d.forwarded()]
    assert_dropped_listing(d.plan)
    assert set(d.plan.kept) | {i for i, _ in d.plan.dropped} == set(range(len(src)))
    last_user = max(i for i, it in enumerate(src) if it.get("role") == "user")
    assert set(range(last_user, len(src))) <= set(d.plan.kept)
    calls = {it["call_id"] for it in out if it["type"] == "function_call"}
    outputs = {it["call_id"] for it in out if it["type"] == "function_call_output"}
    assert calls == outputs
    kept = set(d.plan.kept)
    for i in kept:
        if src[i]["type"] == "reasoning":
            assert i + 1 in kept and src[i + 1]["type"] == "function_call"
    first = next(it for it in out if it.get("role") not in ("system", "developer"))
    assert first.get("role") == "user"


def retyped(items: list[dict[str, Any]], kinds: list[str]) -> list[dict[str, Any]]:
    """Responses items with the k-th function call (and its output) made a call of the
    k-th kind (cycling) in that tool's documented shape; a kind ending in `_call` that
    the gateway does not list stands for a tool newer than it."""
    kind_of: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for it in items:
        t = it.get("type")
        if t == "function_call":
            kind = kind_of.setdefault(it["call_id"], kinds[len(kind_of) % len(kinds)])
            if kind == "shell_call":
                it = {"type": kind, "call_id": it["call_id"], "status": "completed",
                      "action": {"commands": ["ls -la", it["arguments"]], "timeout_ms": 1000}}
            elif kind == "apply_patch_call":
                it = {"type": kind, "call_id": it["call_id"], "status": "completed",
                      "operation": {"type": "update_file", "path": "a.py",
                                    "diff": "@@\n-x\n+" + it["arguments"]}}
            elif kind != "function_call":
                it = {"type": kind, "call_id": it["call_id"], "arguments": it["arguments"]}
        elif t == "function_call_output":
            kind = kind_of[it["call_id"]]
            if kind == "shell_call":
                it = {"type": "shell_call_output", "call_id": it["call_id"], "output": [
                    {"stdout": it["output"], "stderr": "",
                     "outcome": {"type": "exit", "exit_code": 0}}]}
            elif kind != "function_call":
                it = {"type": kind + "_output", "call_id": it["call_id"],
                      "output": it["output"], "status": "completed"}
        out.append(it)
    return out


@pytest.mark.slow
@given(msgs=conversation(), memory=memory_rules(),
       kinds=st.lists(st.sampled_from(["function_call", "shell_call", "apply_patch_call",
                                       "custom_tool_call", "browser_use_call"]),
                      min_size=1, max_size=3))
@settings()
def test_responses_every_call_kind_stays_with_its_output(
    msgs: list[dict[str, Any]], memory: dict[str, Any], kinds: list[str]
) -> None:
    """Calls of every client-run tool (shell, apply_patch, a kind newer than the gateway)
    and their outputs, parallel calls among them, are forwarded in pairs: a call or an
    output alone is a 400 from the API."""
    items = retyped(to_responses(msgs)["input"], kinds)
    raw = orjson.dumps({"model": "gpt-5.1", "input": items})
    d = decide(raw, orjson.loads(raw), make_rules(memory), TOK, OPENAI_RESPONSES)
    assert d.plan is not None, d.skip_reason
    out = orjson.loads(d.forward)["input"]
    assert out == [strip(items[i]) for i in d.forwarded()]
    calls = {it["call_id"] for it in out if str(it.get("type")).endswith("_call")}
    assert calls == {it["call_id"] for it in out
                     if str(it.get("type")).endswith("_call_output")}


def reasoned_responses(msgs: list[dict[str, Any]], layouts: list[tuple[bool, bool]]
                       ) -> tuple[list[dict[str, Any]], list[int | None]]:
    """`msgs` as Responses items from a reasoning model, each tool-calling reply one
    response: a reasoning item, then (layout: preamble) a message, then its calls, each
    call's output right after it (layout: interleaved, the function-calling guide's
    loop) or all after the calls; with the response each item came from (None: none)."""
    items: list[dict[str, Any]] = []
    resp: list[int | None] = []
    outputs: dict[str, dict[str, Any]] = {}
    for m in msgs:
        if m["role"] == "tool":
            out = {"type": "function_call_output", "call_id": m["tool_call_id"],
                   "output": m["content"]}
            if m["tool_call_id"] in outputs:  # placed after its call already
                outputs[m["tool_call_id"]].update(out)
            else:
                items.append(out)
                resp.append(None)
        elif m["role"] == "assistant" and m.get("tool_calls"):
            r = len(items)
            preamble, interleaved = layouts[r % len(layouts)]
            items.append({"type": "reasoning", "id": f"rs_{r}", "summary": [],
                          "encrypted_content": "gAAAA" + "x" * 40})
            resp.append(r)
            if preamble:
                items.append({"type": "message", "role": "assistant", "content": m["content"]
                              or "Let me check."})
                resp.append(r)
            for c in m["tool_calls"]:
                items.append({"type": "function_call", "id": f"fc_{c['id']}",
                              "call_id": c["id"], "name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]})
                resp.append(r)
                if interleaved:
                    outputs[c["id"]] = {}
                    items.append(outputs[c["id"]])
                    resp.append(None)
        else:
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
            resp.append(None)
    return items, resp


@pytest.mark.slow
@given(msgs=conversation(), memory=memory_rules(),
       layouts=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=4))
@settings()
def test_responses_reasoning_stays_with_its_response(
    msgs: list[dict[str, Any]], memory: dict[str, Any], layouts: list[tuple[bool, bool]]
) -> None:
    """A reasoning model's response (its reasoning item, a preamble message, its calls,
    however the client placed the outputs) is forwarded whole or not at all: the API
    refuses an item sent without its reasoning item, and a reasoning item without the
    item after it; call_id pairs stay whole."""
    items, resp = reasoned_responses(msgs, layouts)
    body = {"model": "gpt-5", "instructions": "Be brief.", "input": items}
    raw = orjson.dumps(body)
    d = decide(raw, orjson.loads(raw), make_rules(memory), TOK, OPENAI_RESPONSES)
    assert d.plan is not None, d.skip_reason
    out = orjson.loads(d.forward)["input"]
    assert out == [items[i] for i in d.forwarded()]
    kept = set(d.plan.kept)
    for r in set(resp) - {None}:
        members = {i for i, x in enumerate(resp) if x == r}
        assert members <= kept or not members & kept, (r, sorted(members & kept))
    calls = {it["call_id"] for it in out if it["type"] == "function_call"}
    assert calls == {it["call_id"] for it in out if it["type"] == "function_call_output"}


def test_responses_server_state_is_measured_not_evicted() -> None:
    """previous_response_id means server-side history: skipped with reason server_state."""
    body = {"model": "gpt-4o-mini", "previous_response_id": "resp_1",
            "input": [{"role": "user", "content": "x" * 5000}]}
    raw = orjson.dumps(body)
    rules = make_rules({"enable_eviction": True, "budget": {"max_chars": 10}})
    d = decide(raw, body, rules, TOK, OPENAI_RESPONSES)
    assert d.skip_reason == "server_state" and d.plan is None and d.forward is raw
    assert d.hist_chars() == 5000


def test_responses_string_input_is_measured() -> None:
    """A plain string input is one user message: counted, nothing to evict."""
    raw = orjson.dumps({"model": "gpt-4o-mini", "input": "hello there"})
    d = decide(raw, orjson.loads(raw), make_rules({"enable_eviction": True}), TOK,
               OPENAI_RESPONSES)
    assert d.skip_reason is None and d.hist_chars() == 11 and d.forward is raw
