"""Carry for agents: a dropped task's tool calls leave a note of what it touched and concluded.

Literal requests in the shapes Claude Code (Anthropic Messages: tool_use blocks) and Codex
(Responses: function_call and custom_tool_call items) send, decided with eviction on
under a budget the first task does not fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from gateway.config.rules import build_rules
from gateway.config.schema import Rules
from gateway.decide.chat import decide
from gateway.decide.decision import Decision
from gateway.measure.tokens import Tokenizers
from gateway.wire.anthropic_messages import ANTHROPIC_MESSAGES
from gateway.wire.base import Wire
from gateway.wire.openai_chat import OPENAI_CHAT
from gateway.wire.openai_responses import OPENAI_RESPONSES

ROOT = Path(__file__).resolve().parents[2]
TOK = Tokenizers(10_000)
LONG = "\n".join(f"{k},order-{k},open,2024-05-0{k % 9 + 1}" for k in range(120))


def rules(**carry: Any) -> Rules:
    return build_rules({"memory": {
        "enable_eviction": True, "shadow": False,
        "budget": {"max_tokens": 400, "max_chars": None, "max_messages": None,
                   "max_turns": None},
        "carry": {"rules_file": "carry.yaml", "log_skipped": False, **carry}},
        "tokens": {"models_file": "models.yaml"}}, base_dir=ROOT / "rules")


def decided(body: dict[str, Any], wire: Wire, r: Rules | None = None) -> Decision:
    raw = orjson.dumps(body)
    d = decide(raw, orjson.loads(raw), r or rules(), TOK, wire)
    assert d.plan is not None and d.plan.dropped, "the first task is dropped"
    return d


def tool_use(tid: str, name: str, **args: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tid, "name": name, "input": args}


def result(tid: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid,
                                         "content": [{"type": "text", "text": text}]}]}


CLAUDE_CODE = {
    "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI."}],
    "tools": [{"name": "Read", "description": "Read a file",
               "input_schema": {"type": "object", "properties": {}}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text":
                                      "Summarize the open orders into notes/summary.md"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "I'll look at the orders first."},
            tool_use("toolu_01", "Read", file_path="/repo/data/orders.csv")]},
        result("toolu_01", LONG),
        {"role": "assistant", "content": [
            tool_use("toolu_02", "Bash", command="cd /repo && wc -l data/orders.csv",
                     description="Count the orders")]},
        result("toolu_02", "120 data/orders.csv"),
        {"role": "assistant", "content": [
            tool_use("toolu_03", "Write", file_path="/repo/notes/summary.md",
                     content="# Open orders\n" + LONG)]},
        result("toolu_03", "File created successfully at: /repo/notes/summary.md"),
        {"role": "assistant", "content": [{"type": "text", "text":
            "Wrote the summary of 120 open orders to notes/summary.md. Each row keeps "
            "the order id and its date."}]},
        {"role": "user", "content": [{"type": "text", "text": "Now add a totals line"}]},
        {"role": "assistant", "content": [
            tool_use("toolu_04", "Grep", pattern="order-", path="/repo/notes")]},
        result("toolu_04", "notes/summary.md"),
    ],
}


def test_claude_code_first_task_leaves_what_it_wrote_touched_and_concluded() -> None:
    """Anthropic tool_use blocks: the Write's file_path is a file written, the Read's and
    the Bash command's paths are touched, `cd` sets the working directory, the task's
    closing text is its conclusion, and the Write's 6 KB content is not read."""
    d = decided(CLAUDE_CODE, ANTHROPIC_MESSAGES)
    assert d.snapshot is not None and d.note is not None
    f = d.snapshot.fields
    assert f["files_written"] == ["/repo/notes/summary.md"]
    assert f["files_touched"] == ["/repo/data/orders.csv", "data/orders.csv", "/repo/notes"]
    assert f["workdir"] == "/repo"
    assert f["conclusion"] == ("Wrote the summary of 120 open orders to notes/summary.md.")
    for line in ("- file written: /repo/notes/summary.md",
                 "- file touched: /repo/data/orders.csv", "- working directory: /repo",
                 "- last task concluded: Wrote the summary of 120 open orders"):
        assert line in d.note
    assert "order-1" not in d.note  # file contents and tool results stay out
    texts = [str(m["content"]) for m in orjson.loads(d.forward)["messages"]]
    assert not any("toolu_03" in t for t in texts)  # the Write was dropped
    at = next(k for k, t in enumerate(texts) if "[memgate memory]" in t)
    assert "Now add a totals line" in texts[at + 1]  # the note before the current turn


CODEX = {
    "model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.", "store": False,
    "input": [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Fix the failing test in tests/test_totals.py"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments":
            orjson.dumps({"command": ["bash", "-lc", "pytest -q tests/test_totals.py"],
                          "workdir": "/work/shop"}).decode()},
        {"type": "function_call_output", "call_id": "call_1", "output": LONG},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input":
            "*** Begin Patch\n*** Update File: shop/totals.py\n@@\n-    return sum(x)\n"
            "+    return round(sum(x), 2)\n*** End Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done!"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text":
            "Rounded the total to cents in shop/totals.py; the test passes now."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Also round the tax"}]},
    ],
}


def test_codex_first_task_leaves_the_patched_file_and_its_workdir() -> None:
    """Responses items: a shell function_call's `workdir` and the test file in its command,
    an apply_patch custom_tool_call's `*** Update File:` header (a file written), the
    closing message (its conclusion); the patch body is not read for paths."""
    d = decided(CODEX, OPENAI_RESPONSES)
    assert d.snapshot is not None and d.note is not None
    f = d.snapshot.fields
    assert f["files_written"] == ["shop/totals.py"]
    assert f["files_touched"] == ["tests/test_totals.py"]
    assert f["workdir"] == "/work/shop"
    assert f["conclusion"] == ("Rounded the total to cents in shop/totals.py; the test "
                               "passes now.")
    assert "- file written: shop/totals.py" in d.note
    assert "- working directory: /work/shop" in d.note


def test_chat_tool_calls_arguments_json_strings() -> None:
    """OpenAI chat: `tool_calls[].function.arguments` JSON strings are read the same way."""
    body = {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Write the report"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "write_file", "arguments": orjson.dumps(
                    {"path": "out/report.md", "content": LONG}).decode()}}]},
        {"role": "tool", "tool_call_id": "c1", "content": LONG},
        {"role": "assistant", "content": "The report is in out/report.md."},
        {"role": "user", "content": "Thanks, now send it"}]}
    d = decided(body, OPENAI_CHAT)
    assert d.snapshot is not None
    assert d.snapshot.fields["files_written"] == ["out/report.md"]
    assert d.snapshot.fields["conclusion"] == "The report is in out/report.md."


def test_keep_fields_without_the_agent_fields_leave_them_out() -> None:
    """A deployment whose keep_fields lists the seed's four fields only gets none of the
    agent fields (and no note lines for them)."""
    r = rules(keep_fields=["task_state", "resolved_refs", "confirmed_constraints",
                           "output_file"])
    d = decided(CLAUDE_CODE, ANTHROPIC_MESSAGES, r)
    assert d.snapshot is not None
    assert not {"files_written", "files_touched", "workdir", "conclusion"} & set(
        d.snapshot.fields)
    assert d.note is None or "file written" not in d.note
